"""A run whose loss or weights stop being finite stops on every rank, with an error that
names the epoch and the step and says what to try; it is never retried, and no model with
non-finite weights comes back."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
import torch

from sparktrain.errors import CommError, DivergedError
from sparktrain.models import mlp
from sparktrain.task.divergence import check_finite_weights
from sparktrain.task.run_task import run_partition

from .fixtures import loop_spec, random_parts, run_ranks, spec_with, worker_context

pytestmark = pytest.mark.timeout(120)


def _regression_parts(label_scale: list[float]) -> list[Any]:
    parts = random_parts([40] * len(label_scale), classes=2)
    for part, scale in zip(parts, label_scale, strict=True):
        part.y[:] = part.y * scale
    return parts


def _regression_spec(**config: Any) -> Any:
    return spec_with(
        loop_spec(loss="mse", **config), model_fn=functools.partial(mlp, 4, (8,), 1), num_outputs=1
    )


def _outcomes(spec: Any, parts: list[Any]) -> list[Any]:
    """Every rank's records, or the error it stopped with."""

    def rank_fn(rank: int, coll: Any) -> Any:
        try:
            return run_partition(worker_context(rank, len(parts), coll, spec), parts[rank])
        except Exception as exc:  # compared below, rank by rank
            return exc

    return run_ranks(len(parts), rank_fn, timeout=60)


def test_a_non_finite_loss_stops_every_rank_at_that_step():
    # labels of 1e20: the squared error overflows float32 at the first step on rank 0;
    # rank 1's data is tame, so it learns of the stop in the step's exchange
    spec = _regression_spec(batch_size=8, epochs=3)
    outcomes = _outcomes(spec, _regression_parts([1e20, 1.0]))
    assert isinstance(outcomes[0], DivergedError)
    message = str(outcomes[0])
    assert "epoch 1, step 1 of 5: the training loss is inf on rank 0" in message
    assert "lower lr (now 0.5)" in message and "StandardScaler" in message
    assert isinstance(outcomes[1], CommError)  # stopped, not hung, at the same step
    assert "closed the connection" in str(outcomes[1])  # by rank 0, not at a timeout


@pytest.mark.parametrize("strategy", ["ring", "tree"])
def test_weights_that_explode_stop_the_run_on_every_rank_alike(strategy):
    # a finite loss whose update overflows: every replica holds the same weights, so
    # every rank finds them non-finite at the same epoch's end, or the loss after them
    spec = _regression_spec(lr=1e30, strategy=strategy, epochs=2)
    outcomes = _outcomes(spec, _regression_parts([1e3, 1e3]))
    assert all(isinstance(o, DivergedError) for o in outcomes), outcomes
    assert len({str(o).split(" on rank")[0] for o in outcomes}) == 1


def test_check_finite_weights_names_how_many_tensors_broke():
    params = [torch.ones(3), torch.tensor([1.0, float("nan")]), torch.tensor([np.inf])]
    with pytest.raises(DivergedError, match="epoch 4: 2 of 3 parameter tensors"):
        check_finite_weights(params, 3, 0.1)
    check_finite_weights([torch.ones(2)], 0, 0.1)  # finite: nothing raised


def test_a_diverged_run_is_final_on_the_driver():
    from sparktrain.errors import WorkerError

    text = "Traceback ...\nsparktrain.errors.DivergedError: epoch 1, step 1 of 5: the loss is nan"
    err = WorkerError.from_spark(RuntimeError(text))
    assert isinstance(err, DivergedError)
    assert not isinstance(err, WorkerError | CommError)  # the stage runner retries only those


def test_weights_are_checked_slice_by_slice_to_the_last_value():
    from sparktrain.task import divergence

    big = torch.zeros(3 * divergence._CHECK_SLICE + 5)
    check_finite_weights([big], 0, 0.1)
    big[-1] = float("inf")  # in the short last slice
    with pytest.raises(DivergedError, match="1 of 1 parameter tensors"):
        check_finite_weights([big], 0, 0.1)


def test_a_pipeline_whose_weights_explode_stops_on_every_stage():
    from sparktrain.parallel.stage import train_stage

    from .fixtures import pipeline_parts, pipeline_spec

    spec = pipeline_spec(2, 1, lr=1e30, epochs=2)
    parts = pipeline_parts([40, 40])

    def rank_fn(rank: int, coll: Any) -> Any:
        try:
            return train_stage(worker_context(rank, 2, coll, spec.job), parts[rank], spec)
        except Exception as exc:  # compared below, stage by stage
            return exc

    outcomes = run_ranks(2, rank_fn, timeout=60)
    assert all(isinstance(o, DivergedError) for o in outcomes), outcomes
