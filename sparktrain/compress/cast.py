"""Casts: ``fp16`` and ``bf16`` (2 bytes per value, 2x), and the identity (for ``delta``).

Both are *summable*: the ring and the tree add the half-precision payloads directly
(``np.add`` on float16; :func:`~sparktrain.compress.base.add_bf16` on bfloat16 bits),
so a step moves ``2 (n - 1) / n`` of half the buffer per rank on the ring — fewer bytes
than an all-gather of the payloads (``n - 1`` payloads) for every world size >= 3 and
the same at 2, so the reduce path is always taken.

Error bound (round to nearest): ``|x - x'| <= 2**-11 |x|`` for fp16 (normal range,
values beyond 65504 are clamped to +-65504, NaN sent as 0), ``2**-8 |x|`` for bf16.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from sparktrain.compress.base import (
    BaseCompressor,
    BucketState,
    Ctx,
    Payload,
    SumFn,
    as_tensor,
    expect_len,
    expect_meta,
    expect_parts,
    summable_allreduce,
    to_numpy,
)
from sparktrain.compress.spec import Stage, check_options

FP16_MAX = 65504.0


class Identity(BaseCompressor):
    """No compression (the inner stage of a bare ``delta``)."""

    spec = "none"
    summable = True
    parts_summable = True

    def compress(self, tensor: torch.Tensor, state: BucketState) -> tuple[Payload, Ctx]:
        t = tensor.detach().reshape(-1).to(torch.float32, copy=True)
        return (t.numpy(),), Ctx(t.numel())

    def decompress(self, payload: Payload, ctx: Ctx) -> torch.Tensor:
        expect_meta(ctx, 0, self.spec)
        expect_parts(payload, (np.float32,), self.spec)
        expect_len(payload[0], ctx.numel, "the values")
        return as_tensor(payload[0])

    def payload_nbytes(self, numel: int) -> int:
        return 4 * numel

    def allreduce(
        self, tensor: torch.Tensor, state: BucketState, sum_: SumFn
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return summable_allreduce(self, tensor, state, sum_)


class Half(BaseCompressor):
    """IEEE half precision; values clamped to the finite range."""

    spec = "fp16"
    summable = True
    parts_summable = True

    ddp_hook = "fp16"

    def compress(self, tensor: torch.Tensor, state: BucketState) -> tuple[Payload, Ctx]:
        t = tensor.detach().reshape(-1)
        h = t.to(torch.float16)
        torch.nan_to_num_(h, nan=0.0, posinf=FP16_MAX, neginf=-FP16_MAX)
        return (h.numpy(),), Ctx(t.numel())

    def decompress(self, payload: Payload, ctx: Ctx) -> torch.Tensor:
        expect_meta(ctx, 0, self.spec)
        expect_parts(payload, (np.float16,), self.spec)
        expect_len(payload[0], ctx.numel, "the values")
        return as_tensor(payload[0]).to(torch.float32)

    def add_into(self, out: torch.Tensor, payload: Payload, ctx: Ctx) -> None:
        self.decompress(payload, ctx)  # checks
        out.add_(as_tensor(payload[0]))

    def payload_nbytes(self, numel: int) -> int:
        return 2 * numel

    def allreduce(
        self, tensor: torch.Tensor, state: BucketState, sum_: SumFn
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return summable_allreduce(self, tensor, state, sum_)


class BFloat16(BaseCompressor):
    """bfloat16 (fp32's exponent range, 8 significant bits); int16 bits on the wire."""

    spec = "bf16"
    summable = True
    parts_summable = True

    ddp_hook = "bf16"

    def compress(self, tensor: torch.Tensor, state: BucketState) -> tuple[Payload, Ctx]:
        t = tensor.detach().reshape(-1)
        return (to_numpy(t.to(torch.bfloat16)),), Ctx(t.numel())

    def decompress(self, payload: Payload, ctx: Ctx) -> torch.Tensor:
        expect_meta(ctx, 0, self.spec)
        expect_parts(payload, (np.int16,), self.spec)
        expect_len(payload[0], ctx.numel, "the values")
        return as_tensor(payload[0]).view(torch.bfloat16).to(torch.float32)

    def payload_nbytes(self, numel: int) -> int:
        return 2 * numel

    def allreduce(
        self, tensor: torch.Tensor, state: BucketState, sum_: SumFn
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return summable_allreduce(self, tensor, state, sum_)


def register_all(register: Callable[[str, Callable[[Stage], Any]], None]) -> None:
    def make(cls: type[BaseCompressor]) -> Callable[[Stage], Any]:
        def factory(stage: Stage) -> Any:
            check_options(stage, 0, (), ())
            return cls()

        return factory

    register("fp16", make(Half))
    register("bf16", make(BFloat16))
