"""Loading a saved model must not import or call anything the user did not allow
(sparktrain.ml.allowlist): hostile metadata in a model alone, inside a PipelineModel and
inside a CrossValidatorModel; a user's module once allowed; sparktrain's own factories."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from pyspark.ml import PipelineModel
from pyspark.ml.evaluation import MulticlassClassificationEvaluator
from pyspark.ml.tuning import CrossValidatorModel, ParamGridBuilder

from sparktrain.errors import ConfigError
from sparktrain.ml import TorchClassificationModel, TorchClassifier, allowlist
from sparktrain.models import digits_mlp
from sparktrain.result import state_to_bytes
from tests.unit import user_models

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]

HOSTILE = "tests.unit.hostile_models"
USER = "tests.unit.user_models:tiny"
CONF = "spark.sparktrain.allowedModelModules"


@pytest.fixture(autouse=True)
def _fresh_registry(monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setattr(allowlist, "_REGISTERED", [])


def _model(model_fn: str = "sparktrain.models:digits_mlp") -> TorchClassificationModel:
    """A saved-able classifier without training: the factory's initial weights."""
    module = digits_mlp() if model_fn.startswith("sparktrain.") else user_models.tiny()
    weights = list(module.state_dict().values())
    width, outputs = weights[0].shape[1], weights[-1].shape[0]  # first weight, last bias
    model = TorchClassificationModel()._set_state(
        state_to_bytes(module.state_dict()), num_features=width, num_outputs=outputs
    )
    return model._set(modelFn=model_fn)


def _rewrite(root: Path, model_fn: str, kwargs: dict[str, object]) -> int:
    """Point every saved sparktrain model or estimator under ``root`` at ``model_fn``."""
    count = 0
    for part in root.rglob("metadata/part-*"):
        meta = json.loads(part.read_text())
        if meta["class"].startswith("sparktrain."):
            meta["paramMap"].update(modelFn=model_fn, modelKwargs=json.dumps(kwargs))
            part.write_text(json.dumps(meta) + "\n")
            part.with_name(f".{part.name}.crc").unlink(missing_ok=True)  # Hadoop's checksum
            count += 1
    return count


def _hostile(marker: Path) -> list[tuple[str, dict[str, object]]]:
    """Metadata an attacker could write: each would create ``marker`` or print if called."""
    return [
        ("os:system", {"command": f"touch {marker}"}),
        ("subprocess:run", {"args": ["touch", str(marker)]}),
        ("builtins:print", {"sep": "", "end": "PWNED\n"}),
        (f"{HOSTILE}:net", {}),
    ]


def test_hostile_metadata_is_refused_before_anything_is_imported_or_called(  # type: ignore[no-untyped-def]
    spark, tmp_path, capfd
):
    path = tmp_path / "model"
    _model().save(str(path))
    assert TorchClassificationModel.load(str(path)).numFeatures == 64  # sparktrain.models: loads
    marker = tmp_path / "pwned"
    for model_fn, kwargs in _hostile(marker):
        assert _rewrite(path, model_fn, kwargs) == 1
        with pytest.raises(ConfigError, match="refusing to load") as err:
            TorchClassificationModel.load(str(path))
        module = model_fn.partition(":")[0]
        assert f"allow_model_modules({module!r})" in str(err.value)
        assert "TorchClassificationModel.load(path, model_fn=" in str(err.value)
    assert not marker.exists()
    assert "PWNED" not in capfd.readouterr().out
    assert HOSTILE not in sys.modules

    # a saved estimator: fitting it would import and call its modelFn
    est = tmp_path / "estimator"
    TorchClassifier(modelFn="sparktrain.models:digits_mlp").save(str(est))
    assert TorchClassifier.load(str(est)).getModelFn() == "sparktrain.models:digits_mlp"
    _rewrite(est, "os:system", {"command": f"touch {marker}"})
    with pytest.raises(ConfigError, match="allow_model_modules\\('os'\\)"):
        TorchClassifier.load(str(est))
    assert not marker.exists()


def test_pipeline_and_cross_validator_models_refuse_a_hostile_inner_model(  # type: ignore[no-untyped-def]
    spark, tmp_path
):
    marker = tmp_path / "pwned"
    pipeline = tmp_path / "pipeline"
    PipelineModel([_model()]).save(str(pipeline))
    cv = tmp_path / "cv"
    CrossValidatorModel(_model(), avgMetrics=[0.5])._set(
        estimator=TorchClassifier(modelFn="sparktrain.models:digits_mlp"),
        evaluator=MulticlassClassificationEvaluator(),
        estimatorParamMaps=ParamGridBuilder().build(),
    ).save(str(cv))
    # untouched, they load (pyspark calls TorchClassificationModel.load(path) inside)
    assert isinstance(PipelineModel.load(str(pipeline)).stages[0], TorchClassificationModel)
    assert isinstance(CrossValidatorModel.load(str(cv)).bestModel, TorchClassificationModel)
    for root, load in ((pipeline, PipelineModel.load), (cv, CrossValidatorModel.load)):
        assert _rewrite(root, "os:system", {"command": f"touch {marker}"}) >= 1
        with pytest.raises(ConfigError, match="modelFn 'os:system' is in module 'os'"):
            load(str(root))
    assert not marker.exists()


def test_a_saved_user_model_loads_once_its_module_is_allowed(spark, tmp_path):  # type: ignore[no-untyped-def]
    path = str(tmp_path / "model")
    saved = _model(USER)
    saved.save(path)
    with pytest.raises(ConfigError, match="'tests.unit.user_models'"):
        TorchClassificationModel.load(path)

    # the explicit override: the caller's own factory, not checked
    assert TorchClassificationModel.load(path, model_fn=USER).getModelFn() == USER

    # the Spark conf, read on the driver at load time
    spark.conf.set(CONF, "tests.unit")
    try:
        assert TorchClassificationModel.load(path).numFeatures == 4
    finally:
        spark.conf.unset(CONF)
    with pytest.raises(ConfigError):
        TorchClassificationModel.load(path)

    # the process-wide registry; the executors rebuild it from the checked name
    allowlist.allow_model_modules("tests.unit.user_models")
    loaded = TorchClassificationModel.load(path)
    frame = spark.createDataFrame([([1.0, 2.0, 3.0, 4.0],)], "features array<double>")
    got = loaded.transform(frame).first()
    want = saved.getModule()(torch.tensor([[1.0, 2.0, 3.0, 4.0]])).argmax(dim=1).item()
    assert got is not None and got.prediction == float(want)
