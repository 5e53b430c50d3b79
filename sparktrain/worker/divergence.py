"""Stopping a run whose loss or weights are no longer finite, with an error that says
where and what to try. A non-finite loss is caught on the rank that computed it, before
the step's exchange (its peers stop in that exchange); non-finite weights after an epoch
are caught on every rank alike, since replicas hold the same weights. Both are final:
a restart from the same state would diverge again, so the stage runner does not retry a
:class:`~sparktrain.errors.DivergedError`."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sparktrain.errors import DivergedError


def diverged(
    where: str, epoch: int, step: int, steps: int, value: float, lr: float
) -> DivergedError:
    """The error of a non-finite training loss (``where``: e.g. ``"on rank 1"``), with
    what to try."""
    return DivergedError(
        f"epoch {epoch + 1}, step {step + 1} of {steps}: the training loss is {value} {where}, "
        "so training stopped (every rank stops at this step). Try a lower lr (now "
        f"{lr:g}), standardising the features and, for regression, the label (e.g. "
        "pyspark.ml.feature.StandardScaler; targets in the hundreds make an MSE loss "
        "explode), or a smaller batch_size; check the data for extreme values"
    )


def check_finite_weights(params: Sequence[torch.Tensor], epoch: int, lr: float) -> None:
    """Stop when a step left a non-finite weight: no such model is returned."""
    with torch.no_grad():
        bad = [i for i, p in enumerate(params) if not _finite(p)]
    if bad:
        raise DivergedError(
            f"epoch {epoch + 1}: {len(bad)} of {len(params)} parameter tensors hold NaN or "
            f"infinite values after the update, so training stopped. Try a lower lr (now "
            f"{lr:g}) or standardising the features and the label"
        )


# isfinite() builds temporaries as large as its input: a parameter near the memory bound
# is checked a slice at a time
_CHECK_SLICE = 1 << 20


def _finite(tensor: torch.Tensor) -> bool:
    flat = tensor.detach().reshape(-1)
    return all(bool(torch.isfinite(part).all()) for part in flat.split(_CHECK_SLICE))
