"""transform's UDF body without Spark: the module is built once per Python worker, the
UDF returns the model's outputs alone, the driver's one-row columns of predictions only
compute no probabilities, and where it scores."""

from __future__ import annotations

import logging

import numpy as np
import pyarrow as pa
import pytest
import torch

from sparktrain.ml import model as ml_model
from sparktrain.ml.model import InlineWeights, _InferencePlan, inference_device
from sparktrain.models import digits_mlp
from sparktrain.result import state_to_bytes

ALL = ("rawPrediction", "probability", "prediction")


def _features(rows: np.ndarray) -> pa.Array:
    n, width = rows.shape
    offsets = pa.array(np.arange(0, (n + 1) * width, width, dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, pa.array(rows.reshape(-1)))


def _plan(module: torch.nn.Module, fields: tuple[str, ...], token: str) -> _InferencePlan:
    return _InferencePlan(
        token=token,
        weights=InlineWeights(state_to_bytes(module.state_dict())),
        model_fn="sparktrain.models:digits_mlp",
        model_kwargs={},
        num_features=64,
        kind="classification",
        threads=1,
        fields=fields,
    )


@pytest.fixture
def empty_cache(monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setattr(ml_model, "_MODULES", type(ml_model._MODULES)())


def test_the_module_is_built_once_for_many_batches_and_tasks(monkeypatch, empty_cache):  # type: ignore[no-untyped-def]
    built = []
    real = ml_model.build_module

    def counting(model_fn, kwargs):  # type: ignore[no-untyped-def]
        built.append(model_fn)
        return real(model_fn, kwargs)

    monkeypatch.setattr(ml_model, "build_module", counting)
    torch.manual_seed(0)
    module = digits_mlp().eval()
    x = np.random.default_rng(0).random((50, 64), dtype=np.float32)
    batches = [_features(x[i : i + 10]) for i in range(0, 50, 10)]
    plan = _plan(module, ALL, "weights-a")
    for _task in range(3):  # a worker runs task after task, each with its own batches
        outs = list(plan.run(iter(batches)))
        assert [len(o) for o in outs] == [10] * 5
    assert built == ["sparktrain.models:digits_mlp"]
    # the trained weights, not a fresh module's; the UDF returns the outputs in float64
    # (the columns are Spark expressions over them)
    got = np.concatenate([np.array(o.to_pylist()) for o in outs])
    with torch.no_grad():
        want = module(torch.from_numpy(x)).double().numpy()
    np.testing.assert_array_equal(got, want)
    # other weights (another model's token) get their own module
    list(_plan(digits_mlp(), ALL, "weights-b").run(iter(batches[:1])))
    assert len(built) == 2


def test_the_udf_returns_the_outputs_and_a_regressor_its_first_unscaled() -> None:
    out = torch.tensor([[1.5, -2.0], [0.25, 3.0]])
    clf = _plan(digits_mlp(), ALL, "t")
    assert clf.scores_type() == "array<double>"
    assert clf.scores(out).to_pylist() == [[1.5, -2.0], [0.25, 3.0]]
    assert clf.scores(None).type == pa.list_(pa.float64()) and len(clf.scores(None)) == 0
    reg = _plan(digits_mlp(), ("prediction",), "t")
    reg.kind, reg.label_stats = "regression", (10.0, 2.0)
    assert reg.scores_type() == "double"
    # label scaling is the prediction column's expression, not the UDF's
    assert reg.scores(out[:, :1]).to_pylist() == [1.5, 0.25]
    assert reg.scores(torch.tensor([0.5])).to_pylist() == [0.5]
    assert reg.scores(None).type == pa.float64()


def test_a_prediction_only_row_computes_no_probabilities(monkeypatch):  # type: ignore[no-untyped-def]
    calls = []
    real_list, real_softmax = ml_model._list_array, torch.softmax

    def counting_list(matrix):  # type: ignore[no-untyped-def]
        calls.append("list")
        return real_list(matrix)

    def counting_softmax(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append("softmax")
        return real_softmax(*args, **kwargs)

    monkeypatch.setattr(ml_model, "_list_array", counting_list)
    monkeypatch.setattr(torch, "softmax", counting_softmax)
    module = digits_mlp()
    out = torch.randn(64, 10)
    out[0, 3] = out[0, 7] = out[0].max() + 1  # a tie: the first class, as argmax of softmax
    lean = _plan(module, ("prediction",), "t").outputs(out)
    assert calls == []
    assert lean.type.names == ["prediction"]
    full = _plan(module, ALL, "t").outputs(out)
    assert sorted(calls) == ["list", "list", "softmax"]
    assert lean.field("prediction").to_pylist() == full.field("prediction").to_pylist()
    assert lean.field("prediction")[0].as_py() == 3.0


def test_a_single_logit_predicts_the_same_class_without_probabilities():
    module = digits_mlp()
    z = torch.tensor([[-2.0], [0.0], [1e-30], [3.0], [-1e-30]])
    lean = _plan(module, ("prediction",), "t").outputs(z)
    full = _plan(module, ALL, "t").outputs(z)
    assert lean.field("prediction").to_pylist() == full.field("prediction").to_pylist()
    assert lean.field("prediction").to_pylist()[:2] == [0.0, 0.0]
    assert lean.field("prediction").to_pylist()[3] == 1.0


def test_scoring_is_on_the_cpu_without_a_task_gpu(caplog):  # type: ignore[no-untyped-def]
    # outside a Spark task there is no TaskContext, hence no GPU
    assert inference_device("cpu") == torch.device("cpu")
    assert inference_device("auto") == torch.device("cpu")
    with caplog.at_level(logging.WARNING, logger="sparktrain.ml.model"):
        # a model fitted with device='cuda' still scores on a CPU-only cluster
        assert inference_device("cuda") == torch.device("cpu")
    assert "transform scores on the CPU" in caplog.text


def test_a_model_that_returns_another_number_of_classes_is_refused(empty_cache):  # type: ignore[no-untyped-def]
    """The output columns read the fitted number of outputs by position: a model function
    that returns another number (changed modelKwargs) fails with the fix, not with
    probabilities of the wrong classes."""
    import dataclasses

    from sparktrain.errors import DataError

    torch.manual_seed(0)
    module = digits_mlp().eval()
    x = np.random.default_rng(0).random((4, 64), dtype=np.float32)
    fitted = dataclasses.replace(_plan(module, ALL, "classes-10"), classes=10)
    assert len(next(fitted.run(iter([_features(x)])))[0]) == 10
    other = dataclasses.replace(_plan(module, ALL, "classes-3"), classes=3)
    with pytest.raises(DataError, match="returns 10 outputs per row, this classifier was fitted"):
        next(other.run(iter([_features(x)])))
