"""``int8``: symmetric 8-bit quantisation with one float32 scale per chunk of values.

Payload: ``int8[numel]`` codes and ``float32[ceil(numel / chunk)]`` scales
(``scale = max|x| / 127`` over the chunk): ``1 + 4 / chunk`` bytes per value, 3.98x
for the default ``chunk=1024``. Decoding is ``code * scale``.

Error bound per element: ``|x - x'| <= scale / 2`` with round-to-nearest, and
``< scale`` with ``stochastic`` rounding (unbiased: ``E[x'] = x``; draws from a private
generator per bucket seeded by (seed, bucket, stream) — never from torch's global one).

Path: not summable (each rank's scales differ). Payloads are all-gathered and every rank
decodes and sums them in rank order (``(n - 1)`` payloads per rank). A
decompress-add-recompress ring would move ``2 (n - 1) / n`` payloads, fewer for n >= 3,
but re-quantises partial sums ``n - 1`` times with errors no rank's error feedback
sees; at n = 2 both move one payload. See ``sparktrain/compress/collective.py``.
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
    Stage,
    as_tensor,
    bad,
    check_options,
    expect_len,
    expect_meta,
    expect_parts,
    int_option,
)

GEN_SLOT = "int8.generator"


class Int8(BaseCompressor):
    summable = False

    def __init__(self, chunk: int = 1024, stochastic: bool = False) -> None:
        self.chunk = int(chunk)
        self.stochastic = bool(stochastic)
        opts = [f"chunk={self.chunk}"] if self.chunk != 1024 else []
        if stochastic:
            opts.append("stochastic")
        self.spec = "int8" + (":" + ",".join(opts) if opts else "")

    def _chunks(self, numel: int) -> int:
        return -(-numel // self.chunk)

    def compress(self, tensor: torch.Tensor, state: BucketState) -> tuple[Payload, Ctx]:
        t = tensor.detach().reshape(-1).to(torch.float32)
        n = t.numel()
        m = self._chunks(n)
        pad = m * self.chunk - n
        full = torch.nn.functional.pad(t, (0, pad)) if pad else t
        rows = full.view(m, self.chunk)
        low, high = torch.aminmax(rows, dim=1)
        scales = torch.maximum(high, low.neg_()).div_(127.0)
        inv = torch.where(scales > 0, scales.reciprocal(), torch.zeros_like(scales))
        y = rows * inv.unsqueeze(1)  # |y| <= 127 (up to one ulp), so no clamp is needed
        if self.stochastic:
            gen = state.slots.get(GEN_SLOT)
            if gen is None:
                gen = torch.Generator().manual_seed(
                    (state.seed * 1_000_003 + state.key * 7919 + state.stream * 104_729 + 31)
                    & ((1 << 63) - 1)
                )
                state.slots[GEN_SLOT] = gen
            noise = torch.rand(y.shape, dtype=y.dtype, generator=gen)
            y.add_(noise).floor_().clamp_(-127, 127)
        else:
            y.round_()
        codes = y.to(torch.int8).reshape(-1)[:n]
        return (codes.contiguous().numpy(), scales.numpy()), Ctx(n)

    def _check(self, payload: Payload, ctx: Ctx) -> None:
        expect_meta(ctx, 0, self.spec)
        expect_parts(payload, (np.int8, np.float32), self.spec)
        expect_len(payload[0], ctx.numel, "the codes")
        expect_len(payload[1], self._chunks(ctx.numel), "the scales")
        if payload[1].size and not np.isfinite(payload[1]).all():
            raise bad("int8 scales are not finite")

    def decompress(self, payload: Payload, ctx: Ctx) -> torch.Tensor:
        self._check(payload, ctx)
        n = ctx.numel
        m = self._chunks(n)
        codes, scales = as_tensor(payload[0]), as_tensor(payload[1])
        out = torch.empty(m * self.chunk, dtype=torch.float32)
        out[:n] = codes
        if m * self.chunk > n:
            out[n:] = 0
        out.view(m, self.chunk).mul_(scales.unsqueeze(1))
        return out[:n]

    def payload_nbytes(self, numel: int) -> int:
        return numel + 4 * self._chunks(numel)


def register_all(register: Callable[[str, Callable[[Stage], Any]], None]) -> None:
    def factory(stage: Stage) -> Any:
        check_options(stage, 0, ("chunk",), ("stochastic",))
        return Int8(
            chunk=int_option(stage, "chunk", 1024, low=1), stochastic="stochastic" in stage.args
        )

    register("int8", factory)
