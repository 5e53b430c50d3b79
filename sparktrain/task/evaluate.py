"""Loss targets and validation metrics, shared by every strategy (barrier-stage loops on
the executors and the driver-side tree_aggregate rounds)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from sparktrain.builders import is_classification
from sparktrain.data.batch import Collator, forward
from sparktrain.data.partition_data import PartitionData
from sparktrain.task.scores import Scores
from sparktrain.wire.tree import TreeAllreduce

# Validation runs in slices so that memory stays bounded on large partitions.
EVAL_SLICE = 8192


def model_device(model: nn.Module) -> torch.device:
    """Where ``model``'s parameters live (the CPU for a model without any)."""
    first = next(model.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


def target_like(y: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Regression and BCE targets take the output's shape ((n,) labels vs (n, 1) outputs)."""
    if y.dtype.is_floating_point and y.shape != out.shape and y.numel() == out.numel():
        return y.view_as(out)
    return y


def metric_name(loss: Any, has_validation: bool) -> str:
    """``accuracy`` or ``rmse``, prefixed ``train_`` when measured on the training rows."""
    name = "accuracy" if is_classification(loss) else "rmse"
    return name if has_validation else f"train_{name}"


def evaluate(
    model: nn.Module,
    data: PartitionData,
    loss: Any,
    collator: Collator | None = None,
    partition: int = 0,
) -> tuple[float, float]:
    """(correct count or squared-error sum, rows) over ``data``; sums add up across ranks.
    With ``k`` labels a row, each row counts the mean over its labels (accuracy per
    label, squared error per output), so the metric is over every label."""
    collator = collator or Collator(data.layout)
    was_training = model.training
    model.eval()
    device = model_device(model)
    total = 0.0
    with torch.no_grad():
        for start in range(0, data.size, EVAL_SLICE):
            rows = np.arange(start, min(start + EVAL_SLICE, data.size))
            batch = data.batch(rows, collator, partition)
            assert batch.labels is not None
            y = batch.labels
            out = forward(model, batch.to(device)).cpu()
            per_row = y[0].numel() if y.ndim > 1 else 1
            if loss == "cross_entropy":
                total += float((out.argmax(dim=1) == y.long()).sum())
            elif loss == "bce_with_logits":
                hits = (out.reshape(-1) > 0).double() == y.reshape(-1)
                total += float(hits.sum()) / per_row
            else:
                diff = out.double().reshape(y.shape[0], -1) - y.reshape(y.shape[0], -1)
                total += float((diff**2).sum()) / per_row
    model.train(was_training)
    return total, float(data.size)


def finish_metric(total: float, rows: float, loss: Any, label_scale: float = 1.0) -> float:
    """Accuracy = correct / rows; RMSE = sqrt(squared error / rows), times
    ``label_scale`` (labels standardised by ``label_scaling``: back to label units); NaN
    without rows."""
    if rows == 0:
        return float("nan")
    if is_classification(loss):
        return total / rows
    return math.sqrt(total / rows) * label_scale


def feed_scores(
    model: nn.Module,
    data: PartitionData,
    scores: Scores,
    collator: Collator | None = None,
    partition: int = 0,
    autocast: Callable[[], contextlib.AbstractContextManager[None]] | None = None,
) -> None:
    """Run ``model`` over ``data`` in slices and feed outputs, labels and weights to
    ``scores`` (no collective: ranks may hold different numbers of rows)."""
    collator = collator or Collator(data.layout)
    was_training = model.training
    model.eval()
    device = model_device(model)
    with torch.no_grad():
        for start in range(0, data.size, EVAL_SLICE):
            rows = np.arange(start, min(start + EVAL_SLICE, data.size))
            batch = data.batch(rows, collator, partition)
            assert batch.labels is not None
            with autocast() if autocast is not None else contextlib.nullcontext():
                out = forward(model, batch.to(device))
            scores.update(out.float().cpu(), batch.labels, batch.weights)
    model.train(was_training)


def finish_scores(scores: Scores, tree: TreeAllreduce) -> dict[str, float]:
    """:meth:`Scores.finish` over the mesh: sums by the tree allreduce, rows (AUC,
    callables) by its all-gather. Every rank calls it at the same point."""

    def reduce_sum(values: np.ndarray) -> np.ndarray:
        buf = np.array(values, dtype=np.float64)
        tree.allreduce_(buf)
        return buf

    def gather(rows: np.ndarray) -> np.ndarray:
        width = rows.shape[1]
        blob = np.ascontiguousarray(rows, dtype=np.float64).reshape(-1).view(np.uint8)
        parts = tree.allgather(blob, max_bytes=tree.mesh.max_frame_bytes)
        return np.concatenate(
            [np.frombuffer(p.tobytes(), dtype=np.float64).reshape(-1, width) for p in parts]
        )

    return scores.finish(reduce_sum, gather)
