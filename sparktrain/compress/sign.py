"""``sign``: one bit per value plus float32 scales, bit-packed.

Compress: ``scale = mean |x|`` (the l1 norm over the values it covers, as in
EF-signSGD), bits ``x >= 0`` packed eight to a byte. Decode: ``+-scale``. By default
one scale covers the whole bucket (32x smaller than fp32); ``sign:chunk=N`` keeps one
scale per chunk of ``N`` values (``1 + 32 / N`` bits per value: 16x at ``chunk=32``).

The error ``x - x'`` is large per element, which is why ``sign`` wants ``+ef``. But
with error feedback the single bucket-wide scale is a weak contraction (it keeps a
share ``||x||_1^2 / (d ||x||_2^2)`` of the energy, small when magnitudes are uneven,
as between the layers of one bucket): the residual grows to several times the gradient
and with SGD momentum 0.9 at lr 0.1 training diverges (digits MLP and CNN, issue 5).
Per-chunk scales alone are not enough (``sign:chunk=32+ef`` still diverges on the CNN
at lr 0.1; at lr 0.05 it is fine there but 2 pp short on the MLP). What works at the
recipe's lr 0.1: per-chunk scales *and* the momentum moved inside the error-feedback
loop, ``sign:chunk=32+ef:momentum=0.9`` with optimizer momentum 0 (see
:mod:`sparktrain.compress.feedback`): 16x smaller than fp32. It still needs
``drop_last=true`` on the digits CNN: an epoch's final step of one or two samples per
rank is enough to make it diverge there.

Path: not summable (each rank has its own scales). At world 2 the payloads are
all-gathered; from world 3 the decompress-add-recompress ring moves fewer bytes
(``2 (n - 1) / n`` payloads instead of ``n - 1``) and, with ``+ef``, every re-encoding
error goes into the residual of the rank that made it (see
:mod:`sparktrain.compress.collective`).
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

ABS_SLOT = "sign.abs"


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Bool tensor -> uint8, eight to a byte, most significant bit first (padded with 0);
    numpy's vectorised ``packbits`` on the tensor's memory."""
    return torch.from_numpy(np.packbits(bits.reshape(-1).contiguous().numpy()))


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``n`` bits as a bool tensor."""
    out = np.unpackbits(packed.numpy(), count=n).view(np.bool_)
    return torch.from_numpy(out)


class Sign(BaseCompressor):
    summable = False
    ring_path = "recompress"
    # Measured on the digits CNN at a global batch of 64: sign:chunk=32+ef:momentum=0.9
    # on the recompress ring collapses at world 8 (seeds 0 and 1: 0.10 and 0.69
    # accuracy); on the all-gather it ends at 0.98. A partial sum of j ranks costs about
    # sqrt(j) times one rank's error, so the residuals grow with the hops.
    coarse = True

    def __init__(self, chunk: int = 0) -> None:
        self.chunk = int(chunk)
        self.spec = "sign" + (f":chunk={self.chunk}" if self.chunk else "")

    def _layout(self, numel: int) -> tuple[int, int, int]:
        """``(width, full rows, elements left over)``: values are scaled row by row."""
        width = self.chunk or max(numel, 1)
        full, rest = divmod(numel, width)
        return width, full, rest

    def _scales(self, numel: int) -> int:
        _, full, rest = self._layout(numel)
        return full + (1 if rest else 0)

    def compress(self, tensor: torch.Tensor, state: BucketState) -> tuple[Payload, Ctx]:
        t = tensor.detach().reshape(-1).to(torch.float32)
        n = t.numel()
        width, full, rest = self._layout(n)
        main = full * width
        if self.chunk:
            # |x| into a buffer kept in the state, then short row sums: a reduction over
            # rows of 32 (vector_norm(dim=1)) is about 10x slower than this here
            mag = state.slots.get(ABS_SLOT)
            if not isinstance(mag, torch.Tensor) or mag.numel() != main:
                mag = torch.empty(main, dtype=torch.float32)
                state.slots[ABS_SLOT] = mag
            torch.abs(t[:main], out=mag)
            parts = [mag.view(full, width).sum(dim=1).div_(width)]
        else:  # one row: a single l1 norm, no temporary
            parts = [torch.linalg.vector_norm(t[:main], 1).div(width).reshape(-1)[:full]]
        if rest:
            parts.append(torch.linalg.vector_norm(t[main:], 1).div(rest).reshape(1))
        scales = torch.cat(parts) if len(parts) > 1 else parts[0]
        return (pack_bits(t >= 0).numpy(), scales.numpy()), Ctx(n)

    def decompress(self, payload: Payload, ctx: Ctx) -> torch.Tensor:
        expect_meta(ctx, 0, self.spec)
        expect_parts(payload, (np.uint8, np.float32), self.spec)
        n = ctx.numel
        expect_len(payload[0], (n + 7) // 8, "the sign bits")
        expect_len(payload[1], self._scales(n), "the scales")
        if payload[1].size and not np.isfinite(payload[1]).all():
            raise bad("sign scales are not finite")
        bits = unpack_bits(as_tensor(payload[0]), n)
        scales = as_tensor(payload[1])
        width, full, rest = self._layout(n)
        main = full * width
        # (2 b - 1) s = 2 s b - s: a bool -> float copy, then one fused multiply-add per
        # row block (torch.where with broadcast scales is ~15x slower on this CPU)
        out = bits.to(torch.float32)
        s = scales[:full].unsqueeze(1)
        rows = out[:main].view(full, width)
        torch.addcmul(s.neg(), rows, s.mul(2.0), out=rows)
        if rest:
            tail = out[main:]
            torch.addcmul(scales[full:].neg(), tail, scales[full:].mul(2.0), out=tail)
        return out

    def payload_nbytes(self, numel: int) -> int:
        return (numel + 7) // 8 + 4 * self._scales(numel)


def register_all(register: Callable[[str, Callable[[Stage], Any]], None]) -> None:
    def factory(stage: Stage) -> Any:
        check_options(stage, 0, ("chunk",), ())
        return Sign(chunk=int_option(stage, "chunk", 0, low=0))

    register("sign", factory)
