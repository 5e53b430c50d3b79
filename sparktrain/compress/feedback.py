"""``+ef``: error feedback around any compressor.

Per bucket, the residual ``e`` (what compression left out so far) is added to the next
input: ``x = g + e; send C(x); e = x - D(C(x))``. So over T steps
``sum(sent) = sum(g) - e_T``: nothing is lost, only delayed. ``+ef:reset=N`` zeroes the
residual every N steps (0 = never), bounding how stale the carried error can get.

For summable compressors the residual is ``x - local`` where ``local`` is this rank's
own contribution to the reduced total (for PowerSGD, its projection ``P P^T x``), so the
identity above holds for the sum over ranks too.

Scale: the ring and treeAggregate compress ``n_r g_r`` (sample count times the mean-loss
gradient) and divide the sum by ``N = sum(n_r)``. A residual kept in those units would be
divided by a later step's ``N``: after a short last batch of an epoch (``N`` = 2 instead
of 64) the carried error would land 32 times too large and training diverges. So the
caller puts ``n_r`` in the state (slot ``ef.scale``) and the residual is kept per sample:
``x = n_r (g + e)``; ``e = (x - D(C(x))) / n_r``. A rank with ``n_r = 0`` sends its
(zero) input and keeps ``e`` for later. Without the slot the scale is 1.

Momentum correction (``+ef:momentum=M``, DGC: Lin et al. 2018, "Deep Gradient
Compression"): the momentum is applied *before* compression, per rank, and the
optimizer must then run without momentum (``sparktrain.config`` checks it). Per bucket
``u = M u + g``; ``x = e + u``; send ``C(x)``; ``e = x - D(C(x))``. For sparse
compressors (topk, randomk) ``u`` is zeroed where something was sent (momentum factor
masking), so a coordinate that finally goes out after accumulating for many steps does
not keep being pushed by stale momentum. Dense compressors send every coordinate every
step, so masking would clear all momentum (plain SGD): they keep ``u`` whole, which is
error feedback on the momentum update (Zheng et al. 2019, "Communication-efficient
distributed blockwise momentum SGD with error-feedback"). That is what makes ``sign``
train with momentum: ``sign:chunk=32+ef:momentum=0.9`` (optimizer momentum 0, and
``drop_last=true`` so that no step has only a sample or two) stays within 1 pp of the
uncompressed run on the digits models, where ``sign+ef`` with the
optimizer's momentum diverges (see :mod:`sparktrain.compress.sign`).

``+ef:momentum=M,nesterov=1`` is the Nesterov form of momentum correction (DGC's
appendix; torch's ``SGD(nesterov=True)``): ``u = M u + g``; ``x = e + g + M u``. What the
optimizer does with ``nesterov=True`` moves into the compressor as the plain form does.

``+ef:momentum=M,mask=0`` turns momentum factor masking off for a sparse compressor
(the default is on for sparse compressors, off for dense ones; ``mask=1`` on a dense
compressor is refused: it would clear all momentum every step).

Local gradient clipping (``+ef:local_clip=C``, DGC section 3.3): each rank clips its own
per-sample bucket gradient ``g`` (the input divided by ``ef.scale``), before it enters
the momentum and before the residual is added, to L2 norm ``C / sqrt(N)`` where ``N``
is the world size from slot ``ef.world`` (default 1): the sum of N independent
gradients of norm ``C / sqrt(N)`` has norm about ``C``. The residual otherwise grows
without bound on a rank whose gradient spikes, and what it sends later is stale. This
is apart from the loop's global ``clip_grad_norm`` (after the exchange). The steps
seen and the steps clipped are counted in the state (:func:`clip_fraction`).

Spec options print in a fixed order (``reset``, ``momentum``, ``nesterov``, ``mask``,
``local_clip``)
and only when they differ from the default, so a spec round-trips through
:func:`sparktrain.compress.registry.build` and checkpoints of older runs still match.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from sparktrain.compress.base import (
    BaseCompressor,
    BucketState,
    Compressor,
    Ctx,
    Payload,
    SumFn,
)
from sparktrain.errors import ConfigError

RESIDUAL = "ef.residual"
MOMENTUM = "ef.momentum"
SCALE = "ef.scale"
"""Optional slot set by the caller each step: the input is ``SCALE`` times the quantity
whose error is fed back (the ring and treeAggregate compress ``n_r g_r``; the residual
must be kept per sample, see the module docstring)."""


WORLD = "ef.world"
"""Optional slot set by the caller each step next to ``SCALE``: the number of ranks whose
inputs are summed (``local_clip`` clips to ``C / sqrt(world)``). Missing means 1."""
CLIP_STEPS = "ef.clip_steps"
"""Steps a ``local_clip`` compressor saw with samples (a plain int in the state)."""
CLIPPED = "ef.clipped"
"""Of those, the steps whose gradient was clipped."""


def clip_fraction(state: BucketState) -> float | None:
    """The fraction of this bucket's steps that ``+ef:local_clip`` clipped (None when
    the compressor does not clip or has seen no step)."""
    seen = int(state.slots.get(CLIP_STEPS, 0))
    return int(state.slots.get(CLIPPED, 0)) / seen if seen else None


def _number(value: float) -> str:
    """``value`` as short text that parses back to the same float."""
    short = f"{value:g}"
    return short if float(short) == value else repr(value)


class ErrorFeedback(BaseCompressor):
    """Error feedback around ``inner`` (see the module docstring).

    ``reset``: zero the residual every N steps (0 = never). ``momentum``: DGC momentum
    correction factor (0 = off); ``nesterov``: its Nesterov form. ``mask``: momentum
    factor masking (None = on for sparse compressors, off for dense ones).
    ``local_clip``: per-rank L2 clip ``C`` of the per-sample gradient, scaled by
    ``1/sqrt(world)`` (0 = off).
    """

    def __init__(
        self,
        inner: Compressor,
        reset: int = 0,
        momentum: float = 0.0,
        mask: bool | None = None,
        local_clip: float = 0.0,
        nesterov: bool = False,
    ) -> None:
        self.inner = inner
        self.reset = int(reset)
        self.momentum = float(momentum)
        self.nesterov = bool(nesterov)
        self.local_clip = float(local_clip)
        self.summable = inner.summable
        sparse = bool(getattr(inner, "sparse", False))
        if mask is not None and not self.momentum:
            raise ConfigError(
                f"compression {inner.spec}+ef: mask= only applies with momentum=M (it masks "
                "the momentum at the coordinates sent); add momentum=0.9 or drop mask="
            )
        if self.nesterov and not self.momentum:
            raise ConfigError(
                f"compression {inner.spec}+ef: nesterov=1 is a form of momentum correction: "
                "add momentum=0.9 or drop nesterov="
            )
        if mask and not sparse:
            raise ConfigError(
                f"compression {inner.spec}+ef: mask=1 needs a sparse compressor (topk, "
                "randomk); a dense one sends every coordinate every step, so masking would "
                "clear all momentum (plain SGD). Drop mask=1"
            )
        if not (math.isfinite(self.local_clip) and self.local_clip >= 0.0):
            raise ConfigError(
                f"compression {inner.spec}+ef: local_clip={local_clip!r} must be a finite "
                "number > 0 (0 = off), e.g. local_clip=1.0"
            )
        self.mask = sparse if mask is None else bool(mask)  # momentum factor masking
        opts = [f"reset={self.reset}"] * bool(self.reset) + [f"momentum={self.momentum:g}"] * bool(
            self.momentum
        )
        if self.nesterov:
            opts.append("nesterov=1")
        if self.momentum and self.mask != sparse:
            opts.append(f"mask={int(self.mask)}")
        if self.local_clip:
            opts.append(f"local_clip={_number(self.local_clip)}")
        self.spec = f"{inner.spec}+ef" + (":" + ",".join(opts) if opts else "")

    def _clip(self, g: torch.Tensor, state: BucketState) -> torch.Tensor:
        """``g`` clipped to L2 norm ``local_clip / sqrt(world)`` (a new tensor if so)."""
        world = float(state.slots.get(WORLD, 1.0))
        if not world >= 1.0:
            raise ValueError(f"slot {WORLD} = {world!r}: the world size must be >= 1")
        limit = self.local_clip / math.sqrt(world)
        norm = float(torch.linalg.vector_norm(g))
        state.slots[CLIP_STEPS] = int(state.slots.get(CLIP_STEPS, 0)) + 1
        if norm <= limit:
            return g
        state.slots[CLIPPED] = int(state.slots.get(CLIPPED, 0)) + 1
        # never in place: without a scale g is the caller's tensor
        return g * (limit / norm)

    def _input(self, tensor: torch.Tensor, state: BucketState) -> tuple[torch.Tensor, float]:
        """``(x, s)``: the compressor's input and the scale it is expressed in."""
        t = tensor.detach().reshape(-1).to(torch.float32)
        s = float(state.slots.get(SCALE, 1.0))
        if s <= 0.0:  # no samples: nothing to weigh the carried error with; keep it
            return t.clone(), s
        g = t if s == 1.0 else t / s
        if self.local_clip:
            g = self._clip(g, state)
        if self.momentum:
            u = state.slots.get(MOMENTUM)
            if u is None or u.numel() != g.numel():
                u = g.clone()
            else:
                u.mul_(self.momentum).add_(g)
            state.slots[MOMENTUM] = u
            # Nesterov: the step looks ahead along the momentum (torch's SGD nesterov=True)
            g = g.add(u, alpha=self.momentum) if self.nesterov else u
        residual = state.slots.get(RESIDUAL)
        if residual is None or residual.numel() != g.numel():
            x = g.clone()
        else:
            if self.reset and state.step > 0 and state.step % self.reset == 0:
                residual.zero_()
            x = g + residual
        if s != 1.0:
            x.mul_(s)
        return x, s

    def _keep(
        self,
        state: BucketState,
        x: torch.Tensor,
        sent: torch.Tensor,
        s: float,
        *,
        mask: torch.Tensor | None = None,
    ) -> None:
        """Store what was left out (in per-sample units) and mask the momentum where
        ``mask`` is true (default: where ``sent`` is nonzero; the resparsify ring passes
        the coordinates the reduced result holds)."""
        if s <= 0.0:
            return
        if self.momentum and self.mask:  # momentum factor masking: forget what was sent
            state.slots[MOMENTUM].masked_fill_(sent != 0 if mask is None else mask, 0.0)
        residual = x.sub_(sent)
        state.slots[RESIDUAL] = residual if s == 1.0 else residual.div_(s)

    @property
    def plain(self) -> bool:
        """Plain ``+ef``: no reset, momentum, masking or clipping (what DDP's hooks have)."""
        return not (self.reset or self.momentum or self.local_clip or self.mask)

    def compress(self, tensor: torch.Tensor, state: BucketState) -> tuple[Payload, Ctx]:
        x, s = self._input(tensor, state)
        payload, ctx = self.inner.compress(x, state)
        self._keep(state, x, self.inner.decompress(payload, ctx), s)
        return payload, ctx

    def decompress(self, payload: Payload, ctx: Ctx) -> torch.Tensor:
        return self.inner.decompress(payload, ctx)

    def add_into(self, out: torch.Tensor, payload: Payload, ctx: Ctx) -> None:
        self.inner.add_into(out, payload, ctx)

    def payload_nbytes(self, numel: int) -> int:
        return self.inner.payload_nbytes(numel)

    def allreduce(
        self, tensor: torch.Tensor, state: BucketState, sum_: SumFn
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, s = self._input(tensor, state)
        total, local = self.inner.allreduce(x, state, sum_)  # type: ignore[attr-defined]
        self._keep(state, x, local, s)
        return total, local


def ability(comp: object, name: str) -> Any:
    """``comp``'s answer to ability ``name`` (an attribute of :class:`BaseCompressor`),
    asked of the core compressor under ``+ef``, with the base class's default for a
    compressor that does not declare it."""
    while isinstance(comp, ErrorFeedback):
        comp = comp.inner
    return getattr(comp, name, getattr(BaseCompressor, name))
