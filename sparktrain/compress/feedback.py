"""``+ef``: error feedback around any compressor.

Per bucket, the residual ``e`` (what compression left out so far) is added to the next
input: ``x = g + e; send C(x); e = x - D(C(x))``. So over T steps
``sum(sent) = sum(g) - e_T``: nothing is lost, only delayed. ``+ef:reset=N`` zeroes the
residual every N steps (0 = never), bounding how stale the carried error can get.

For summable compressors the residual is ``x - local`` where ``local`` is this rank's
own contribution to the reduced total (for PowerSGD, its projection ``P P^T x``), so the
identity above holds for the sum over ranks too.
"""

from __future__ import annotations

import torch

from sparktrain.compress.base import BaseCompressor, BucketState, Compressor, Ctx, Payload, SumFn

RESIDUAL = "ef.residual"


class ErrorFeedback(BaseCompressor):
    def __init__(self, inner: Compressor, reset: int = 0) -> None:
        self.inner = inner
        self.reset = int(reset)
        self.summable = inner.summable
        self.spec = f"{inner.spec}+ef" + (f":reset={self.reset}" if self.reset else "")

    def _input(self, tensor: torch.Tensor, state: BucketState) -> torch.Tensor:
        t = tensor.detach().reshape(-1).to(torch.float32)
        residual = state.slots.get(RESIDUAL)
        if residual is None or residual.numel() != t.numel():
            return t.clone()
        if self.reset and state.step > 0 and state.step % self.reset == 0:
            residual.zero_()
        return t + residual

    def compress(self, tensor: torch.Tensor, state: BucketState) -> tuple[Payload, Ctx]:
        x = self._input(tensor, state)
        payload, ctx = self.inner.compress(x, state)
        state.slots[RESIDUAL] = x.sub_(self.inner.decompress(payload, ctx))
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
        x = self._input(tensor, state)
        total, local = self.inner.allreduce(x, state, sum_)  # type: ignore[attr-defined]
        state.slots[RESIDUAL] = x.sub_(local)
        return total, local
