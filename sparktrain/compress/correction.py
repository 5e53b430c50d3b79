"""Momentum correction by default (issue 34.3): top-k under ``+ef`` takes the optimizer's
momentum.

Top-k with error feedback under the optimizer's momentum sends, each step, the top of
``g + e`` while the optimizer's momentum replays what the world sent: the residual ``e``
carries gradient that momentum never saw, and what finally goes out is pushed again by a
stale buffer. Deep Gradient Compression (Lin et al. 2018) moves the momentum in front of
the compressor, per rank, and masks it where something was sent; the optimizer then runs
without momentum (:mod:`sparktrain.compress.feedback`, ``+ef:momentum=M``). Measured on
``conf/digits_mlp.toml`` at world 4 (one seed): 0.909 with the optimizer's momentum,
0.949 with it moved, 0.964 with it moved on the exact all-gather (uncompressed 0.973).

So when a job trains with the built-in loop and
 - ``compression`` is one spec string whose core compressor's class declares
   ``momentum_correction = True`` (``topk``; a plug-in may too) with ``+ef`` and no
   ``momentum=`` of its own, and
 - the optimizer is ``"sgd"`` with ``momentum > 0`` and no ``dampening``,
:func:`move_momentum` returns the spec with ``+ef:momentum=M`` (``nesterov=1`` for
``nesterov=True``) and the optimizer's keyword arguments with ``momentum=0`` (and
``nesterov=False``), and the driver says so once when the job opens
(:func:`sparktrain.driver.job.open_job`).

``randomk`` does not declare it: its positions are random, so a coordinate's momentum
builds up for about ``1 / ratio`` steps before it goes out, and on digits it diverged with
momentum of either kind (0.06 with the optimizer's, 0.10 with momentum correction, 0.91
with none; docs/compression.md). Its remedy is the optimizer's momentum at 0, which the
divergence check names.

What keeps today's behaviour: ``+ef:momentum=0`` written in the spec (the optimizer keeps
its momentum), a per-layer table (its unmatched parameters would lose momentum), another
optimizer or ``dampening``, a schedule told to cycle momentum (``cycle_momentum=true``),
``local_steps > 1`` (``tree_aggregate``'s payloads are then model deltas after local
optimizer steps, not gradients), ``compression="auto"`` (chosen inside the stage, after
the optimizer is built) and ``sparktrain.run`` (the user's ``train_fn`` builds its own
optimizer). ``+ef:momentum=M`` together with the optimizer's momentum is refused by the
config, as before. As with a spec's own ``momentum=``, the rows of ``sparse=True``
embedding tables then step without momentum (the row path keeps no per-row momentum).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sparktrain.compress.feedback import _number
from sparktrain.compress.registry import build, parse_spec

if TYPE_CHECKING:
    from sparktrain.config import TrainConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MomentumMove:
    """What :func:`move_momentum` changes: the new spec and optimizer keyword arguments,
    and the sentence the driver logs."""

    compression: str
    optimizer_kwargs: dict[str, Any]
    message: str


def _number_of(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0.0
    return float(value)


def move_momentum(
    compression: Any,
    optimizer: Any,
    optimizer_kwargs: Mapping[str, Any],
    *,
    lr_schedule_kwargs: Mapping[str, Any] | None = None,
    local_steps: int = 1,
) -> MomentumMove | None:
    """The move described in the module docstring, or None when it does not apply."""
    if not isinstance(compression, str) or optimizer != "sgd" or local_steps != 1:
        return None
    if compression.strip().lower() == "auto":  # chosen in the stage, after the optimizer
        return None
    momentum = _number_of(optimizer_kwargs.get("momentum", 0.0))
    if not 0.0 < momentum < 1.0 or _number_of(optimizer_kwargs.get("dampening", 0.0)):
        return None
    if (lr_schedule_kwargs or {}).get("cycle_momentum") is True:
        return None
    stages = parse_spec(compression)
    if not stages or stages[-1].name != "ef" or stages[-1].option("momentum") is not None:
        return None
    core: Any = build(compression)
    while hasattr(core, "inner"):  # +ef, delta+
        core = core.inner
    if not getattr(core, "momentum_correction", False):
        return None
    nesterov = bool(optimizer_kwargs.get("nesterov", False))
    text = "".join(compression.split())
    head, _, ef = text.rpartition("+")
    options = ef.partition(":")[2]
    added = f"momentum={_number(momentum)}" + (",nesterov=1" if nesterov else "")
    spec = f"{head}+{ef.partition(':')[0]}:" + (f"{options},{added}" if options else added)
    build(spec)  # the same compressor with momentum correction: it must build
    kwargs = {**optimizer_kwargs, "momentum": 0.0}
    if nesterov:
        kwargs["nesterov"] = False
    message = (
        f"compression={compression!r} with SGD momentum {momentum:g}"
        + (" (Nesterov)" if nesterov else "")
        + f": the momentum moves into the compressor, compression={spec!r} with the "
        "optimizer's momentum 0 (DGC momentum correction: the optimizer's momentum would "
        "replay the residual's stale gradient; docs/compression.md, 'Top-k out of the "
        f"box'). To keep the optimizer's momentum instead, write {_opt_out(compression)!r}"
    )
    return MomentumMove(compression=spec, optimizer_kwargs=kwargs, message=message)


def _opt_out(compression: str) -> str:
    """``compression`` with an explicit ``momentum=0`` on its ``+ef``: no move."""
    text = "".join(compression.split())
    head, _, ef = text.rpartition("+")
    name, _, options = ef.partition(":")
    return f"{head}+{name}:" + (f"{options},momentum=0" if options else "momentum=0")


def apply_momentum_correction(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with the optimizer's momentum moved into its compressor when
    :func:`move_momentum` applies (a copy; logged once), else ``cfg`` itself."""
    move = move_momentum(
        cfg.compression,
        cfg.optimizer,
        cfg.optimizer_kwargs if isinstance(cfg.optimizer_kwargs, Mapping) else {},
        lr_schedule_kwargs=(
            cfg.lr_schedule_kwargs if isinstance(cfg.lr_schedule_kwargs, Mapping) else None
        ),
        local_steps=cfg.local_steps,
    )
    if move is None:
        return cfg
    log.warning("%s", move.message)
    return cfg.replace(compression=move.compression, optimizer_kwargs=move.optimizer_kwargs)
