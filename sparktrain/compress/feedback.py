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
"""

from __future__ import annotations

import torch

from sparktrain.compress.base import BaseCompressor, BucketState, Compressor, Ctx, Payload, SumFn

RESIDUAL = "ef.residual"
MOMENTUM = "ef.momentum"
SCALE = "ef.scale"
"""Optional slot set by the caller each step: the input is ``SCALE`` times the quantity
whose error is fed back (the ring and treeAggregate compress ``n_r g_r``; the residual
must be kept per sample, see the module docstring)."""


class ErrorFeedback(BaseCompressor):
    def __init__(self, inner: Compressor, reset: int = 0, momentum: float = 0.0) -> None:
        self.inner = inner
        self.reset = int(reset)
        self.momentum = float(momentum)
        self.summable = inner.summable
        self.mask = bool(getattr(inner, "sparse", False))  # momentum factor masking
        opts = [f"reset={self.reset}"] * bool(self.reset) + [f"momentum={self.momentum:g}"] * bool(
            self.momentum
        )
        self.spec = f"{inner.spec}+ef" + (":" + ",".join(opts) if opts else "")

    def _input(self, tensor: torch.Tensor, state: BucketState) -> tuple[torch.Tensor, float]:
        """``(x, s)``: the compressor's input and the scale it is expressed in."""
        t = tensor.detach().reshape(-1).to(torch.float32)
        s = float(state.slots.get(SCALE, 1.0))
        if s <= 0.0:  # no samples: nothing to weigh the carried error with; keep it
            return t.clone(), s
        g = t if s == 1.0 else t / s
        if self.momentum:
            u = state.slots.get(MOMENTUM)
            if u is None or u.numel() != g.numel():
                u = g.clone()
            else:
                u.mul_(self.momentum).add_(g)
            state.slots[MOMENTUM] = u
            g = u
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
