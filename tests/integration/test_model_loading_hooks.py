"""Issue 31: a saved model ran shell commands through its ``decode``.

The allowlist covered ``modelFn`` only; the other ``module:function`` names a saved model
keeps (``decode``, ``collate``, as params and in the saved ``inputs`` layout that
``transform`` runs on the executors) were imported and called there unchecked. These
tests fit a real :class:`TorchClassifier` on a binary column, save it in a
``PipelineModel`` behind a stock ``SQLTransformer``, edit only the metadata files, as
whoever hands out the model directory could, and load it.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pyspark.ml import Pipeline, PipelineModel
from pyspark.ml.feature import SQLTransformer

from sparktrain.errors import ConfigError
from sparktrain.ml import TorchClassificationModel, TorchClassifier, allowlist
from sparktrain.ml import persistence as persistence_module
from sparktrain.ml.allowlist import check_saved_model_fn

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]

HOSTILE = "tests.unit.hostile_models"
USER = "tests.unit.user_hooks"  # the issue's "mypkg": the user's own decode
_SAVED: dict[str, Path] = {}  # the fitted pipeline, saved once for the module


@pytest.fixture(autouse=True)
def _fresh_registry(monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setattr(allowlist, "_REGISTERED", [])


def _iris(spark):  # type: ignore[no-untyped-def]
    """scikit-learn's iris with its four features as one binary (float32 bytes) column."""
    from sklearn.datasets import load_iris

    x, y = load_iris(return_X_y=True)
    rows = [
        (bytearray(r.astype(np.float32).tobytes()), float(c)) for r, c in zip(x, y, strict=True)
    ]
    return spark.createDataFrame(rows, "x binary, label double")


def _classifier(**params: Any) -> TorchClassifier:
    return TorchClassifier(
        modelFn="sparktrain.models:mlp",
        modelKwargs={"in_features": 4, "hidden": [8], "out_features": 3},
        featuresCol="x",
        decode={"x": f"{USER}:f32"},
        numWorkers=1,
        maxEpochs=1,
        **params,
    )


@pytest.fixture()
def saved(spark, tmp_path, tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    """A copy of the saved PipelineModel [SQLTransformer, TorchClassificationModel]."""
    if "pipeline" not in _SAVED:
        fitted = _classifier().fit(_iris(spark))
        path = tmp_path_factory.mktemp("fitted") / "pipeline"
        PipelineModel([SQLTransformer(statement="SELECT * FROM __THIS__"), fitted]).save(str(path))
        _SAVED["pipeline"] = path
    copy = tmp_path / "pipeline"
    shutil.copytree(_SAVED["pipeline"], copy)
    return copy


def _edit(root: Path, change: Callable[[dict[str, Any]], None], cls: str) -> None:
    """Rewrite the metadata of the stage under ``root`` whose class ends with ``cls``."""
    edited = 0
    for part in root.rglob("metadata/part-*"):
        meta = json.loads(part.read_text())
        if meta["class"].endswith(cls):
            change(meta)
            part.write_text(json.dumps(meta) + "\n")
            part.with_name(f".{part.name}.crc").unlink(missing_ok=True)  # Hadoop's checksum
            edited += 1
    assert edited == 1, f"no single {cls} under {root}"


def _sql(root: Path, statement: str) -> None:
    _edit(root, lambda meta: meta["paramMap"].update(statement=statement), ".SQLTransformer")


def _hooks(root: Path, hook: str, param: bool = True, layout: bool = True, what: str = "decode"):  # type: ignore[no-untyped-def]
    """Point the model's ``what`` for column x at ``hook``: the param, the saved layout."""

    def change(meta: dict[str, Any]) -> None:
        if param:
            meta["paramMap"][what] = json.dumps({"x": hook})
        if layout:
            meta["inputs"]["columns"][0][what] = hook

    _edit(root, change, "TorchClassificationModel")


def _old_loader(instance, path, model_fn, allowed, layout=None) -> None:  # type: ignore[no-untyped-def]
    """What loading checked before issue 31: the modelFn alone."""
    if model_fn is None:
        check_saved_model_fn(instance.getModelFn(), allowed, source=path, override_hint="")


def test_issue_31_os_system_as_a_pipeline_models_decode_runs_nothing(  # type: ignore[no-untyped-def]
    spark, saved, tmp_path, monkeypatch
):
    df = _iris(spark)
    allowlist.allow_model_modules(USER)  # the user's decode module: as the issue does
    untouched = PipelineModel.load(str(saved)).transform(df)
    assert untouched.select("prediction").distinct().count() >= 1  # loads and predicts

    marker = tmp_path / "ran"
    _sql(saved, f"SELECT CAST('touch {marker}' AS BINARY) AS x, label FROM __THIS__ LIMIT 1")
    _hooks(saved, "os:system")

    # before the fix: the loader checked modelFn only, and transform ran the command on
    # an executor (os.system returns an int, not a row: the job fails after it ran)
    with monkeypatch.context() as old:
        old.setattr(persistence_module, "check_loaded_names", _old_loader, raising=False)
        loaded = PipelineModel.load(str(saved))
        with pytest.raises(Exception, match="same dtype"):  # the model got the exit status
            loaded.transform(df).collect()
    assert marker.exists(), "the hostile decode did not run on the old loader"
    marker.unlink()

    # now: refused at load, on the driver, naming the field, the module and the fix
    with pytest.raises(ConfigError) as err:
        PipelineModel.load(str(saved))
    text = str(err.value)
    assert "its decode['x'] 'os:system' is in module 'os'" in text
    assert "sparktrain.ml.allow_model_modules('os')" in text
    assert not marker.exists()


@pytest.mark.parametrize(
    ("what", "param", "layout", "field"),
    [
        ("decode", False, True, "inputs.decode['x']"),  # what transform runs
        ("collate", False, True, "inputs.collate['x']"),
        ("decode", True, False, "decode['x']"),  # the params
        ("collate", True, False, "collate['x']"),
    ],
)
def test_each_hook_field_of_a_saved_model_is_checked_before_it_is_imported(  # type: ignore[no-untyped-def]
    spark, saved, tmp_path, what, param, layout, field
):
    allowlist.allow_model_modules(USER)
    marker = tmp_path / "ran"
    _sql(saved, f"SELECT CAST('{marker}' AS BINARY) AS x, label FROM __THIS__ LIMIT 1")
    _hooks(saved, f"{HOSTILE}:touch", param=param, layout=layout, what=what)
    model_dir = next((saved / "stages").glob("*TorchClassificationModel*"))
    for load, where in ((PipelineModel.load, saved), (TorchClassificationModel.load, model_dir)):
        with pytest.raises(ConfigError) as err:
            load(str(where))
        text = str(err.value)
        assert f"its {field} '{HOSTILE}:touch' is in module '{HOSTILE}'" in text
        assert f"sparktrain.ml.allow_model_modules('{HOSTILE}')" in text
    assert not marker.exists()
    assert HOSTILE not in sys.modules  # never imported on the driver


def test_the_weights_file_must_stay_inside_the_model_directory(spark, saved, tmp_path):  # type: ignore[no-untyped-def]
    allowlist.allow_model_modules(USER)
    model_dir = next((saved / "stages").glob("*TorchClassificationModel*"))
    outside = tmp_path / "elsewhere.pt"
    shutil.copy(model_dir / "data" / "weights.pt", outside)  # a valid file: loads if read
    for name in (f"../../../{outside.name}", str(outside), outside.as_uri()):
        _edit(saved, lambda meta, n=name: meta.update(weightsFile=n), "TorchClassificationModel")
        with pytest.raises(ConfigError, match="weightsFile .* is not a path inside the model"):
            TorchClassificationModel.load(str(model_dir))


def test_a_saved_estimator_is_checked_and_drops_its_logger_destinations(  # type: ignore[no-untyped-def]
    spark, tmp_path, caplog
):
    path = tmp_path / "pipeline"
    estimator = _classifier(mlflowTrackingUri="http://attacker:5000", tensorboardDir="/tmp/tb")
    Pipeline(stages=[SQLTransformer(statement="SELECT * FROM __THIS__"), estimator]).save(str(path))
    allowlist.allow_model_modules(USER)
    with caplog.at_level(logging.WARNING, logger="sparktrain.ml.persistence"):
        loaded = Pipeline.load(str(path)).getStages()[1]
    assert isinstance(loaded, TorchClassifier)
    assert (loaded.getMlflowTrackingUri(), loaded.getTensorboardDir()) == ("", "")
    assert loaded.getDecode() == json.dumps({"x": f"{USER}:f32"})  # allowed: kept
    assert "setMlflowTrackingUri('http://attacker:5000')" in caplog.text

    stage = next((path / "stages").glob("*TorchClassifier*"))
    user_decode = json.dumps({"x": f"{USER}:f32"})
    for what in ("decode", "collate"):  # one hostile field at a time
        hostile = {"decode": user_decode, what: json.dumps({"x": "os:system"})}
        _edit(path, lambda meta, h=hostile: meta["paramMap"].update(h), "TorchClassifier")
        for load, where in ((Pipeline.load, path), (TorchClassifier.load, stage)):
            with pytest.raises(ConfigError, match=rf"its {what}\['x'\] 'os:system' is in module"):
                load(str(where))

    # the class field: pyspark's own reader would import it and call it with no arguments
    _edit(path, lambda meta: meta.update({"class": f"{HOSTILE}.net"}), "TorchClassifier")
    with pytest.raises(ConfigError, match=f"names the class '{HOSTILE}.net'"):
        TorchClassifier.load(str(stage))
    assert HOSTILE not in sys.modules
