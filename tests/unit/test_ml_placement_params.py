"""The ml Params of issue 19's TrainConfig keys (device, gpusPerTask, commBackend,
driverServicesHost, driverServicesPorts): TrainConfig's defaults, mapped onto its keys,
checked when set, carried by the fitted model, persisted in MLlib metadata, and absent
from older saves without harm."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pyspark.ml.util import DefaultParamsReader

from sparktrain.config import TrainConfig
from sparktrain.ml import (
    TorchClassificationModel,
    TorchClassifier,
    TorchRegressionModel,
    TorchRegressor,
)

# each param and the TrainConfig key it sets
PLACEMENT = {
    "device": "device",
    "gpusPerTask": "gpus_per_task",
    "commBackend": "comm_backend",
    "driverServicesHost": "driver_services_host",
    "driverServicesPorts": "driver_services_ports",
}
# values other than the defaults (commBackend='torch' needs no GPU: Gloo)
VALUES: dict[str, Any] = {
    "device": "cpu",
    "gpusPerTask": 1,
    "commBackend": "torch",
    "driverServicesHost": "127.0.0.1",
    "driverServicesPorts": "40000-40099",
}


def _config(stage: Any) -> dict[str, Any]:
    cfg = stage._train_config()
    return {key: getattr(cfg, key) for key in PLACEMENT.values()}


def _getter(stage: Any, param: str) -> Any:
    return getattr(stage, f"get{param[0].upper()}{param[1:]}")()


def test_the_params_exist_everywhere_with_train_config_defaults() -> None:
    cfg = TrainConfig()
    defaults = {key: getattr(cfg, key) for key in PLACEMENT.values()}
    assert defaults == {
        "device": "auto",
        "gpus_per_task": 0,
        "comm_backend": "sparktrain",
        "driver_services_host": "",
        "driver_services_ports": "",
    }
    for cls in (TorchClassifier, TorchRegressor, TorchClassificationModel, TorchRegressionModel):
        stage = cls()
        assert all(stage.hasParam(p) for p in PLACEMENT), cls
        assert _config(stage) == defaults
        assert not any(stage.isSet(stage.getParam(p)) for p in PLACEMENT)


def test_values_map_onto_train_config_by_keyword_setter_and_set_params() -> None:
    wanted = {PLACEMENT[p]: v for p, v in VALUES.items()}
    for cls in (TorchClassifier, TorchRegressor):
        assert _config(cls(modelFn="sparktrain.models:mlp", **VALUES)) == wanted
        chained = cls(modelFn="sparktrain.models:mlp")
        for param, value in VALUES.items():
            chained = getattr(chained, f"set{param[0].upper()}{param[1:]}")(value)
        assert _config(chained) == wanted
        assert _config(cls().setParams(modelFn="sparktrain.models:mlp", **VALUES)) == wanted
    # what fit trains with
    assert TorchClassifier(modelFn="sparktrain.models:mlp", **VALUES)._resolve()[0].device == "cpu"


def test_the_fitted_model_carries_them() -> None:
    clf = TorchClassifier(modelFn="sparktrain.models:digits_mlp", **VALUES)
    model = TorchClassificationModel()
    clf._copyValues(model)
    assert {p: _getter(model, p) for p in PLACEMENT} == VALUES
    # transform's own address for large weights under Spark Connect
    model.setDriverServicesHost("10.0.0.5").setDriverServicesPorts("41000-41009")
    assert (model.getDriverServicesHost(), model.getDriverServicesPorts()) == (
        "10.0.0.5",
        "41000-41009",
    )


@pytest.mark.parametrize(
    ("param", "value", "error", "match"),
    [
        ("device", "tpu", ValueError, "device='tpu'.*auto, cpu, cuda"),
        ("gpusPerTask", -1, ValueError, "gpusPerTask=-1 must be an integer >= 0"),
        ("gpusPerTask", 0.5, TypeError, 'param "gpusPerTask"'),
        ("commBackend", "nccl", ValueError, "commBackend='nccl'.*sparktrain, torch"),
        ("driverServicesHost", 3, TypeError, 'param "driverServicesHost"'),
        ("driverServicesPorts", "80-90", ValueError, "driverServicesPorts='80-90'"),
        ("driverServicesPorts", "40000-", ValueError, "driverServicesPorts='40000-'"),
    ],
)
def test_bad_values_are_refused_naming_the_param(
    param: str, value: Any, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        TorchClassifier(**{param: value})
    with pytest.raises(error, match=match):
        getattr(TorchRegressor(), f"set{param[0].upper()}{param[1:]}")(value)


def _metadata(stage: Any, drop: frozenset[str] = frozenset(), **extra: Any) -> dict[str, Any]:
    """What DefaultParamsWriter writes for ``stage`` (less the params in ``drop``: a save
    from before they existed), as read back from the file."""
    metadata = {
        "class": f"{type(stage).__module__}.{type(stage).__name__}",
        "timestamp": 0,
        "sparkVersion": "4.1.0",
        "uid": stage.uid,
        "paramMap": {p.name: v for p, v in stage._paramMap.items() if p.name not in drop},
        "defaultParamMap": {
            p.name: v for p, v in stage._defaultParamMap.items() if p.name not in drop
        },
        **extra,
    }
    return json.loads(json.dumps(metadata))


def test_saves_keep_the_values_and_older_saves_load_with_the_defaults() -> None:
    wanted = {PLACEMENT[p]: v for p, v in VALUES.items()}
    defaults = _config(TorchClassifier())
    for cls in (TorchClassifier, TorchRegressor):
        saved = _metadata(cls(modelFn="sparktrain.models:mlp", **VALUES))
        loaded = cls()
        DefaultParamsReader.getAndSetParams(loaded, saved)
        assert _config(loaded) == wanted
        old = _metadata(cls(modelFn="sparktrain.models:mlp", maxEpochs=3), frozenset(PLACEMENT))
        assert not set(PLACEMENT) & (set(old["paramMap"]) | set(old["defaultParamMap"]))
        before = cls()
        DefaultParamsReader.getAndSetParams(before, old)
        assert before.getMaxEpochs() == 3 and _config(before) == defaults
    for model_cls in (TorchClassificationModel, TorchRegressionModel):
        model = model_cls()._set(modelFn="sparktrain.models:mlp", **VALUES)
        loaded_model = model_cls()
        DefaultParamsReader.getAndSetParams(loaded_model, _metadata(model, numFeatures=64))
        assert {p: _getter(loaded_model, p) for p in PLACEMENT} == VALUES
        old_model = model_cls()
        DefaultParamsReader.getAndSetParams(
            old_model, _metadata(model_cls()._set(modelFn="x.y:z"), frozenset(PLACEMENT))
        )
        assert _config(old_model) == defaults
