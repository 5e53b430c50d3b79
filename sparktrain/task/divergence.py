"""Stopping a run whose loss or weights are no longer finite, or whose loss grew by orders
of magnitude, with an error that says where and what to try. A non-finite loss is caught
on the rank that computed it, before the step's exchange (its peers stop in that
exchange); non-finite weights after an epoch are caught on every rank alike, since
replicas hold the same weights, and so is an epoch's mean loss that outgrew the run's
best (:func:`check_loss_growth`: every rank holds the same exact epoch loss and history).
All are final: a restart from the same state would diverge again, so the stage runner
does not retry a :class:`~sparktrain.errors.DivergedError`."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from sparktrain.config import TrainConfig
from sparktrain.errors import DivergedError

# The growth check's reference is the lowest epoch mean so far, but no lower than this
# share of the first epoch's: a cross-entropy trained to 0.001 may bump to 0.1 and
# recover, which is no divergence; a loss 10x the first epoch's (with the default
# factor of 20), far worse than the barely trained model's, is.
FIRST_EPOCH_SHARE = 0.5

_DATA_HINT = (
    "standardising the features and, for regression, the label (e.g. "
    "pyspark.ml.feature.StandardScaler; targets in the hundreds make an MSE loss "
    "explode), or a smaller batch_size; check the data for extreme values"
)


def diverged(
    where: str, epoch: int, step: int, steps: int, value: float, lr: float
) -> DivergedError:
    """The error of a non-finite training loss (``where``: e.g. ``"on rank 1"``), with
    what to try."""
    return DivergedError(
        f"epoch {epoch + 1}, step {step + 1} of {steps}: the training loss is {value} {where}, "
        "so training stopped (every rank stops at this step). Try a lower lr (now "
        f"{lr:g}), {_DATA_HINT}"
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


def loss_blowup(losses: Sequence[float], factor: float) -> tuple[int, float] | None:
    """When the last of the epoch mean ``losses`` exceeds ``factor`` times the reference
    (the lowest earlier one, no lower than :data:`FIRST_EPOCH_SHARE` of the first), the
    reference's epoch index and value; else None. Off for ``factor`` 0, with fewer than
    two epochs, or when the first epoch's loss is not a positive number (a loss that can
    be negative has no scale to grow by)."""
    if factor <= 0 or len(losses) < 2:
        return None
    first, last = float(losses[0]), float(losses[-1])
    if not (math.isfinite(first) and first > 0):
        return None
    earlier = list(losses[:-1])
    best = min(range(len(earlier)), key=lambda i: earlier[i])
    if earlier[best] >= FIRST_EPOCH_SHARE * first:
        epoch, reference = best, float(earlier[best])
    else:  # trained near zero: the first epoch's scale is the floor
        epoch, reference = 0, FIRST_EPOCH_SHARE * first
    return (epoch, reference) if last > factor * reference else None


def check_loss_growth(
    history: Sequence[Mapping[str, Any]], loss: float, epoch: int, cfg: TrainConfig
) -> None:
    """Stop when epoch ``epoch``'s mean training ``loss`` grew by orders of magnitude over
    the earlier epoch records in ``history`` (:func:`loss_blowup` with the config's
    ``divergence_factor``): a run that diverged short of NaN, as a compressor's growing
    error with the optimizer's momentum does, ends in a model worse than chance."""
    losses = [float(r["loss"]) for r in history if r.get("type", "epoch") == "epoch"]
    found = loss_blowup([*losses, loss], float(cfg.divergence_factor))
    if found is None:
        return
    at, reference = found
    if losses[at] == reference:
        source = f"epoch {at + 1}'s mean, the lowest so far"
    else:
        source = f"{FIRST_EPOCH_SHARE:g} x epoch {at + 1}'s mean {losses[at]:.4g}"
    raise DivergedError(
        f"epoch {epoch + 1}: the mean training loss is {loss:.4g}, {loss / reference:.0f}x "
        f"{reference:.4g} ({source}; divergence_factor={cfg.divergence_factor:g}), so "
        "training stopped on every rank: the run diverged. "
        f"Try {_remedies(cfg)}. divergence_factor=0 turns this check off"
    )


def _remedies(cfg: TrainConfig) -> str:
    """What to try, the compressor's remedy first when it is the likely cause."""
    tries = [f"a lower lr (now {cfg.lr:g})"]
    momentum = cfg.optimizer_kwargs.get("momentum", 0) or 0
    if not isinstance(momentum, int | float):
        momentum = 0
    specs = cfg.compression.values() if isinstance(cfg.compression, dict) else [cfg.compression]
    hints = [h for s in specs if isinstance(s, str) and (h := _compressor_hint(s, momentum))]
    tries[:0] = hints[:1]
    tries.append(_DATA_HINT)
    return "; ".join(tries)


def _compressor_hint(spec: str, momentum: float) -> str | None:
    """The remedy for a sparse or sign compressor with error feedback under momentum (its
    residual grows while momentum amplifies it; docs/compression.md has the figures):
    random-k wants no momentum at all, top-k and sign momentum correction or none."""
    name, ef, feedback = spec.partition("+ef")
    if not ef or "+" in feedback:
        return None
    options = [o for o in feedback.lstrip(":").split(",") if o]
    corrected = any(o.startswith("momentum=") for o in options)
    if "randomk" in name and (momentum > 0 or corrected):
        plain = ",".join(o for o in options if not o.startswith("momentum="))
        return (
            f"for compression={spec!r}: no momentum at all, i.e. compression="
            f"{name + '+ef' + (':' + plain if plain else '')!r} with the optimizer's momentum "
            "at 0 (optimizer_kwargs={momentum = 0}): random-k sends a value about once "
            "in 1/ratio steps, and momentum, the optimizer's or momentum correction's, "
            "amplifies the stale residual (see docs/compression.md)"
        )
    if ("topk" in name or "sign" in name) and momentum > 0 and not corrected:
        corrected_spec = name + "+ef:" + ",".join([*options, f"momentum={momentum:g}"])
        return (
            f"for compression={spec!r} with the optimizer's momentum {momentum:g}: the "
            "optimizer's momentum at 0 (optimizer_kwargs={momentum = 0}), or momentum "
            "correction, which keeps momentum inside error feedback "
            f"(compression={corrected_spec!r} with optimizer momentum 0; see "
            "docs/compression.md)"
        )
    return None
