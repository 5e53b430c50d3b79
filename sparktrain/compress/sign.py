"""``sign``: one bit per value plus one float32 scale (32x smaller than fp32).

Compress: ``scale = mean |x|`` (the l1 norm over n, as in EF-signSGD), bits
``x >= 0`` packed eight to a byte with torch ops. Decode: ``+-scale``. The error
``x - x'`` is ``x - scale * sign(x)``: large per element, which is why ``sign`` wants
``+ef`` (with error feedback the sum of what was sent tracks the sum of inputs).

Path: not summable (each rank has its own scale); all-gathered, ``n - 1`` payloads per
rank. A majority-vote reduce would be summable but changes the estimator; a
decompress-add-recompress ring moves ``2 (n - 1) / n`` payloads but loses the sum's
magnitude information at every hop.
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
    check_options,
    expect_len,
    expect_meta,
    expect_parts,
)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Bool tensor -> uint8, eight to a byte, most significant bit first (padded with 0);
    numpy's vectorised ``packbits`` on the tensor's memory."""
    return torch.from_numpy(np.packbits(bits.reshape(-1).contiguous().numpy()))


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``n`` bits as a bool tensor."""
    out = np.unpackbits(packed.numpy(), count=n).view(np.bool_)
    return torch.from_numpy(out)


class Sign(BaseCompressor):
    spec = "sign"
    summable = False

    def compress(self, tensor: torch.Tensor, state: BucketState) -> tuple[Payload, Ctx]:
        t = tensor.detach().reshape(-1).to(torch.float32)
        n = t.numel()
        scale = float(t.abs().mean()) if n else 0.0
        return (pack_bits(t >= 0).numpy(),), Ctx(n, (scale,))

    def decompress(self, payload: Payload, ctx: Ctx) -> torch.Tensor:
        expect_meta(ctx, 1, self.spec)
        expect_parts(payload, (np.uint8,), self.spec)
        expect_len(payload[0], (ctx.numel + 7) // 8, "the sign bits")
        bits = unpack_bits(as_tensor(payload[0]), ctx.numel)
        scale = float(np.float32(ctx.meta[0]))
        # +-scale as (2 b - 1) * scale, in one fused pass over the unpacked bits
        return torch.where(bits, scale, -scale).to(torch.float32)

    def payload_nbytes(self, numel: int) -> int:
        return (numel + 7) // 8


def register_all(register: Callable[[str, Callable[[Stage], Any]], None]) -> None:
    def factory(stage: Stage) -> Any:
        check_options(stage, 0, (), ())
        return Sign()

    register("sign", factory)
