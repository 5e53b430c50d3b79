"""Every function a saved model's or estimator's metadata names goes through the
allowlist before anything is imported, not only ``modelFn`` (issue 31): the ``decode``
and ``collate`` params (set, or recorded as defaults) and the hooks of a model's saved
``inputs`` layout, which ``transform`` runs on the executors. Also: ``weightsFile`` stays
inside the model directory, and a loaded estimator drops its logger destinations.

No Spark here: the metadata goes through the readers' own steps (pyspark's
``getAndSetParams``, :func:`saved_layout`, :func:`check_loaded_names`);
tests/integration/test_model_loading_hooks.py loads real saved directories."""

from __future__ import annotations

import json
import logging
import sys
from types import SimpleNamespace
from typing import Any

import pytest
from pyspark.ml.util import DefaultParamsReader

from sparktrain.errors import ConfigError
from sparktrain.ml import TorchClassificationModel, TorchClassifier, TorchRegressor, allowlist
from sparktrain.ml.persistence import (
    LOGGER_PARAMS,
    WEIGHTS_FILE,
    check_loaded_names,
    drop_logger_destinations,
    saved_layout,
    saved_weights_file,
)

HOSTILE = "tests.unit.hostile_models"
USER = "tests.unit.user_hooks"
ALLOWED = ("sparktrain.models", USER)


@pytest.fixture(autouse=True)
def _fresh_registry(monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setattr(allowlist, "_REGISTERED", [])


def _metadata(
    params: dict[str, Any] | None = None,
    defaults: dict[str, Any] | None = None,
    decode: object = None,
    collate: object = None,
) -> dict[str, Any]:
    """A model's metadata as TorchModelWriter writes it: one binary column ``x``."""
    column = {"key": "x", "source": "x", "wire": "x", "kind": "binary", "dtype": "float32"}
    column.update(shape=[4], decode=decode or f"{USER}:f32", collate=collate)
    return {
        "class": "sparktrain.ml.model.TorchClassificationModel",
        "uid": "TorchClassificationModel_1",
        "sparkVersion": "4.0.0",
        "paramMap": {"modelFn": "sparktrain.models:mlp", "decode": {"x": f"{USER}:f32"}}
        | (params or {}),
        "defaultParamMap": defaults or {},
        "inputs": {"call": "single", "columns": [column], "label_sources": ["label"]},
    }


def _load(metadata: dict[str, Any], cls: type[Any] = TorchClassificationModel) -> Any:
    """The model reader's steps before the weights: params, layout, the name check."""
    instance = cls()
    DefaultParamsReader.getAndSetParams(instance, metadata)
    layout = saved_layout(metadata, "/models/m") if "inputs" in metadata else None
    check_loaded_names(instance, "/models/m", None, ALLOWED, layout)
    return instance


# Each field a saved model names a function in, pointed at a hostile module: (metadata,
# the field the error names).
HOSTILE_FIELDS = [
    (_metadata(params={"modelFn": f"{HOSTILE}:net"}), "modelFn"),
    (_metadata(defaults={"modelFn": f"{HOSTILE}:net"}), "modelFn (default)"),
    (_metadata(params={"decode": {"x": f"{HOSTILE}:touch"}}), "decode['x']"),
    (_metadata(defaults={"decode": {"x": f"{HOSTILE}:touch"}}), "decode['x'] (default)"),
    (_metadata(params={"collate": {"x": f"{HOSTILE}:touch"}}), "collate['x']"),
    (_metadata(defaults={"collate": {"x": f"{HOSTILE}:touch"}}), "collate['x'] (default)"),
    (_metadata(decode=f"{HOSTILE}:touch"), "inputs.decode['x']"),
    (_metadata(collate=f"{HOSTILE}:touch"), "inputs.collate['x']"),
]


@pytest.mark.parametrize(("metadata", "field"), HOSTILE_FIELDS, ids=[f for _, f in HOSTILE_FIELDS])
def test_every_function_a_saved_model_names_is_refused_outside_the_allowlist(metadata, field):  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError) as err:
        _load(metadata)
    text = str(err.value)
    name = f"{HOSTILE}:{'net' if field.startswith('modelFn') else 'touch'}"
    assert f"refusing to load /models/m: its {field} {name!r} is in module {HOSTILE!r}" in text
    assert f"sparktrain.ml.allow_model_modules({HOSTILE!r})" in text
    assert f"spark.sparktrain.allowedModelModules={HOSTILE}" in text
    assert HOSTILE not in sys.modules  # refused before the import: its code never ran


def test_the_untouched_metadata_passes_and_os_system_as_decode_does_not():
    assert _load(_metadata()).getDecode() == json.dumps({"x": f"{USER}:f32"})
    # the edit: the binary column's decode becomes os:system, its module allowed
    for metadata in (
        _metadata(params={"decode": {"x": "os:system"}}),
        _metadata(decode="os:system"),
    ):
        with pytest.raises(ConfigError, match=r"allow_model_modules\('os'\)"):
            _load(metadata)
    # allowing 'os' is not enough: os.system is defined in posix
    with pytest.raises(ConfigError, match="'system' is defined in 'posix', not in 'os'"):
        check_loaded_names(
            TorchClassificationModel(),
            "/models/m",
            "sparktrain.models:mlp",
            (*ALLOWED, "os"),
            saved_layout(_metadata(decode="os:system"), "/models/m"),
        )


def test_every_name_is_checked_before_any_module_is_imported(monkeypatch):  # type: ignore[no-untyped-def]
    imported: list[str] = []
    monkeypatch.setattr(
        allowlist, "importlib", SimpleNamespace(import_module=lambda m: imported.append(m))
    )
    # modelFn and decode are allowed, the layout's collate is not: nothing is imported
    with pytest.raises(ConfigError, match=r"inputs\.collate\['x'\]"):
        _load(_metadata(collate="subprocess:run"))
    assert imported == []


@pytest.mark.parametrize(
    ("hook", "why"),
    [
        (f"{USER}:np.frombuffer", "reaches into module 'numpy'"),  # through the allowed module
        (f"{USER}:_private", "public function"),
        ("os", "public function"),  # no ':function'
        ({"module": "os"}, "public function"),  # not a string (the layout is not typed)
        (3, "public function"),
    ],
)
def test_a_layout_hook_that_escapes_the_allowed_module_or_is_malformed_is_refused(hook, why):  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match="refusing to load /models/m") as err:
        _load(_metadata(decode=hook))
    assert why in str(err.value)


def test_the_callers_model_fn_replaces_the_saved_one_but_the_hooks_are_still_checked():
    metadata = _metadata(
        params={"modelFn": "os:system"}, defaults={"modelFn": "os:system"}, decode="os:system"
    )
    instance = TorchClassificationModel()
    DefaultParamsReader.getAndSetParams(instance, metadata)
    with pytest.raises(ConfigError, match=r"its inputs\.decode\['x'\] 'os:system'"):
        check_loaded_names(
            instance, "/m", "sparktrain.models:mlp", ALLOWED, saved_layout(metadata, "/m")
        )
    # the saved names are gone, the set one and the recorded default
    instance.clear(instance.modelFn)
    assert instance.getModelFn() == "sparktrain.models:mlp"


def test_an_estimators_decode_and_collate_are_checked_as_a_models_are():
    for cls in (TorchClassifier, TorchRegressor):
        metadata = {
            "class": f"sparktrain.ml.estimator.{cls.__name__}",
            "uid": "e",
            "sparkVersion": "4.0.0",
            "paramMap": {"modelFn": "sparktrain.models:mlp", "decode": {"x": f"{USER}:f32"}},
            "defaultParamMap": {},
        }
        assert _load(metadata, cls).getDecode() == json.dumps({"x": f"{USER}:f32"})
        for param in ("decode", "collate"):
            hostile = metadata | {"paramMap": {"modelFn": "sparktrain.models:mlp"}}
            hostile["paramMap"][param] = {"img": "os:system"}
            with pytest.raises(ConfigError, match=rf"its {param}\['img'\] 'os:system'"):
                _load(hostile, cls)


@pytest.mark.parametrize(
    "name",
    [
        "/etc/passwd",
        "../other/data/weights.pt",
        "data/../../x.pt",
        "./data/weights.pt",
        "data//weights.pt",
        "file:///etc/passwd",
        "hdfs://evil:8020/w.pt",
        "s3a:weights.pt",
        "data\\..\\x.pt",
        ".hidden",
        "",
        None,
        7,
    ],
)
def test_the_weights_file_stays_inside_the_model_directory(name):  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match="its weightsFile .* is not a path inside the model"):
        saved_weights_file({"weightsFile": name}, "/models/m")


def test_the_weights_file_sparktrain_writes_is_accepted():
    assert saved_weights_file({"weightsFile": WEIGHTS_FILE}, "/m") == "data/weights.pt"
    assert saved_weights_file({}, "/m") == WEIGHTS_FILE  # saves from before the field
    assert saved_weights_file({"weightsFile": "data/v2/weights-1.pt"}, "/m")


def test_a_loaded_estimator_drops_its_logger_destinations_with_a_warning(caplog):  # type: ignore[no-untyped-def]
    set_ = TorchClassifier(mlflowTrackingUri="http://attacker:5000", tensorboardDir="/tmp/tb")
    recorded = TorchRegressor()
    recorded._setDefault(mlflowTrackingUri="http://attacker:5000")  # in defaultParamMap
    with caplog.at_level(logging.WARNING, logger="sparktrain.ml.persistence"):
        for estimator in (set_, recorded):
            drop_logger_destinations(estimator, "/models/est")
            assert (estimator.getMlflowTrackingUri(), estimator.getTensorboardDir()) == ("", "")
            assert not any(estimator.isSet(estimator.getParam(p)) for p in LOGGER_PARAMS)
            assert estimator._train_config().mlflow_tracking_uri == ""  # fit logs nowhere
    text = caplog.text
    assert "/models/est names logger destinations" in text
    assert "setMlflowTrackingUri('http://attacker:5000')" in text
    assert "setTensorboardDir('/tmp/tb')" in text
    caplog.clear()
    drop_logger_destinations(TorchClassifier(mlflowExperiment="x"), "/m")  # none: no warning
    assert caplog.text == ""
