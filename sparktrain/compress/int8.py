"""``int8``: symmetric 8-bit quantisation with one float32 scale per chunk of values.

Payload: ``int8[numel]`` codes and ``float32[ceil(numel / chunk)]`` scales
(``scale = max|x| / 127`` over the chunk): ``1 + 4 / chunk`` bytes per value, 3.98x
for the default ``chunk=1024``. Decoding is ``code * scale``.

Error bound per element: ``|x - x'| <= scale / 2`` with round-to-nearest, and
``< scale`` with ``stochastic`` rounding (unbiased: ``E[x'] = x``; draws from a private
generator per bucket seeded by (seed, bucket, stream) — never from torch's global one).

Path: not summable (each rank's scales differ). At world 2 the payloads are
all-gathered (one payload per rank, exact); on a ring of 3 or more the
decompress-add-recompress ring moves ``2 (n - 1) / n`` payloads instead of ``n - 1``,
re-quantising partial sums (with ``+ef`` each rank feeds its re-quantisation errors
back). See ``sparktrain/compress/collective.py``.

Speed: two passes to encode (per-chunk max and min; then one fused multiply-add whose
float rounding yields the codes), two to decode, and a float32 work buffer kept in the
bucket's state, so no 4-byte-per-value temporary is allocated per step.
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
    as_tensor,
    bad,
    expect_len,
    expect_meta,
    expect_parts,
)
from sparktrain.compress.spec import Stage, check_options, int_option

GEN_SLOT = "int8.generator"
SCRATCH_SLOT = "int8.scratch"
_MAGIC = torch.tensor(1.5 * 2**23)  # see Int8._quantize


class Int8(BaseCompressor):
    summable = False
    ring_path = "recompress"

    def __init__(self, chunk: int = 1024, stochastic: bool = False) -> None:
        self.chunk = int(chunk)
        self.stochastic = bool(stochastic)
        opts = [f"chunk={self.chunk}"] if self.chunk != 1024 else []
        if stochastic:
            opts.append("stochastic")
        self.spec = "int8" + (":" + ",".join(opts) if opts else "")

    def _chunks(self, numel: int) -> int:
        return -(-numel // self.chunk)

    def _scratch(self, state: BucketState, rows: int) -> torch.Tensor:
        """A float32 work buffer of ``rows x chunk`` kept in the bucket's state: a fresh
        buffer per step would pay a page fault per 4 KiB (buffers above glibc's 32 MiB
        mmap threshold are returned to the kernel on free)."""
        buf = state.slots.get(SCRATCH_SLOT)
        if not isinstance(buf, torch.Tensor) or buf.shape != (rows, self.chunk):
            buf = torch.empty(rows, self.chunk, dtype=torch.float32)
            state.slots[SCRATCH_SLOT] = buf
        return buf

    def _generator(self, state: BucketState) -> torch.Generator:
        gen = state.slots.get(GEN_SLOT)
        if gen is None:
            gen = torch.Generator().manual_seed(
                (state.seed * 1_000_003 + state.key * 7919 + state.stream * 104_729 + 31)
                & ((1 << 63) - 1)
            )
            state.slots[GEN_SLOT] = gen
        return gen

    def _quantize(
        self, rows: torch.Tensor, codes: torch.Tensor, y: torch.Tensor, state: BucketState
    ) -> torch.Tensor:
        """Codes of ``rows`` (``m x c`` float32) into ``codes`` (``m x c`` int8), using
        ``y`` (``m x c`` float32) as work space; returns the ``m`` scales."""
        # max |x| as max(max x, -min x): two reductions without an |x| temporary
        scales = torch.maximum(rows.amax(dim=1), rows.amin(dim=1).neg_()).div_(127.0)
        inv = torch.where(scales > 0, scales.reciprocal(), torch.zeros_like(scales)).unsqueeze(1)
        if self.stochastic:
            torch.rand(y.shape, dtype=y.dtype, generator=self._generator(state), out=y)
            y.addcmul_(rows, inv).floor_().clamp_(-127, 127)  # floor(x/s + u), u ~ U[0, 1)
            codes.copy_(y)
        else:
            # Round to nearest in the same pass as the multiply: adding 1.5 * 2**23 leaves
            # round(x / s) in the low mantissa bits (|x / s| <= 127 << 2**22), and its
            # low byte is the two's-complement int8 code, so the int32 -> int8 copy
            # (which keeps the low byte) finishes the job.
            torch.addcmul(_MAGIC, rows, inv, out=y)
            codes.copy_(y.view(torch.int32))
        return scales

    def compress(self, tensor: torch.Tensor, state: BucketState) -> tuple[Payload, Ctx]:
        t = tensor.detach().reshape(-1).to(torch.float32)
        n = t.numel()
        full, rest = divmod(n, self.chunk)
        main = full * self.chunk
        codes = torch.empty(n, dtype=torch.int8)
        parts = []
        if full:
            y = self._scratch(state, full)
            parts.append(
                self._quantize(
                    t[:main].view(full, self.chunk), codes[:main].view(full, self.chunk), y, state
                )
            )
        if rest:  # the short last chunk on its own: padding would copy the whole input
            tail = t[main:].view(1, rest)
            y = torch.empty(1, rest, dtype=torch.float32)
            parts.append(self._quantize(tail, codes[main:].view(1, rest), y, state))
        scales = torch.cat(parts) if len(parts) > 1 else (parts[0] if parts else t.new_empty(0))
        return (codes.numpy(), scales.numpy()), Ctx(n)

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
        full = n // self.chunk
        main = full * self.chunk
        codes, scales = as_tensor(payload[0]), as_tensor(payload[1])
        out = torch.empty(n, dtype=torch.float32)
        # two passes (int8 -> float32 copy, in-place scale): a mixed-dtype multiply
        # into ``out`` takes torch's slow type-promotion path (about 2x slower here)
        out[:main].view(full, self.chunk).copy_(codes[:main].view(full, self.chunk))
        out[:main].view(full, self.chunk).mul_(scales[:full].unsqueeze(1))
        if main < n:
            out[main:].copy_(codes[main:]).mul_(scales[full])
        return out

    def payload_nbytes(self, numel: int) -> int:
        return numel + 4 * self._chunks(numel)


def register_all(register: Callable[[str, Callable[[Stage], Any]], None]) -> None:
    def factory(stage: Stage) -> Any:
        check_options(stage, 0, ("chunk",), ("stochastic",))
        return Int8(
            chunk=int_option(stage, "chunk", 1024, low=1), stochastic="stochastic" in stage.args
        )

    register("int8", factory)
