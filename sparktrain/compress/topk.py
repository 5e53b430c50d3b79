"""Sparsifiers: ``topk:R`` (exact or sampled-threshold) and ``randomk:R``.

``topk``: keep the ``k = ceil(R * n)`` values of largest magnitude. Payload: float32
values and the narrowest index type that fits the bucket: uint16 up to 65,536
elements, int32 up to 2**31, int64 beyond. So ``topk:0.01`` is 50x smaller than fp32
on a large bucket (8 bytes per kept value), not 100x, and 66.7x on small buckets and
parameter-server shards (6 bytes per kept value). The exact variant uses
``torch.topk``; ``sampled`` estimates the magnitude threshold from a random sample of
``sample * n`` values (default 1 %, at least 4096) and keeps everything above it —
about ``k`` values (trimmed to at most ``1.25 k`` by an exact top-k of the survivors).
Error: dropped values are returned exactly (``x - x'`` is ``x`` off the kept set, 0 on it).

Sparsity warm-up (``topk:R,warmup=S``, DGC section 3.4): over a bucket's first ``S``
steps (its :class:`~sparktrain.compress.base.BucketState` ``step``) the keep ratio decays
exponentially from 25 % to ``R``: ``0.25 ** (1 - t/S) * R ** (t/S)`` at step ``t < S``
(never below ``R``), then ``R``. Early gradients change fast, and sending more of them
while the residual is young keeps it from piling up stale mass. ``S = 0`` (the default)
is off. The payload carries its own ``k`` (the receiver bounds it by the element
count only); ``payload_nbytes`` is the steady-state size at ``R``, which picks the path.

Path: top-k payloads are not summable (different index sets); they are all-gathered
(``n - 1`` payloads per rank) and every rank scatter-adds them in rank order. That is
the cheapest exact path: the union of index sets grows along a ring, so a
decompress-add-recompress ring would carry as much unless it re-sparsified partial
sums (losing mass that no error feedback sees).

``randomk``: keep ``k`` values at positions drawn from a generator seeded by
(seed, bucket, step) — the same positions on every rank, so only the values travel
(4 bytes per kept value) and payloads are *summable*: they reduce inside the ring.
Not rescaled (biased); use it with ``+ef``.
"""

from __future__ import annotations

import math
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
    bad,
    expect_meta,
    expect_parts,
    summable_allreduce,
)
from sparktrain.compress.spec import Stage, check_options, float_option, int_option
from sparktrain.errors import ConfigError

WARMUP_START = 0.25
"""The keep ratio a ``warmup=S`` top-k starts from (DGC's 25 %)."""


def keep_count(ratio: float, numel: int) -> int:
    return 0 if numel == 0 else min(numel, max(1, math.ceil(ratio * numel)))


def step_seed(state: BucketState, salt: int) -> int:
    """A 52-bit seed from (seed, bucket, step): exact in a float64 ctx number."""
    h = (state.seed * 1_000_003 + state.key * 7919 + state.step * 104_729 + salt) & ((1 << 52) - 1)
    return int(h)


def index_dtype(numel: int) -> type[np.integer[Any]]:
    """The narrowest index type for a bucket of ``numel`` elements (both ends agree: it
    depends only on ``ctx.numel``)."""
    if numel <= 1 << 16:
        return np.uint16
    return np.int32 if numel < 2**31 else np.int64


_STRIPES = 16


def above(t: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """Indices (int64, in no useful order) of the elements with ``|t| >= threshold``.

    ``nonzero`` over a mask of all ``n`` elements is the slow part of a sampled top-k
    (single pass, but about 3 ns per element here), so the vector is cut into 16
    stripes laid side by side: an elementwise max and min across the stripes (vector
    ops, no ``|t|`` temporary) finds the columns holding a survivor — about 15 % of
    them at a 1 % keep ratio — and only those columns are masked and searched.
    """
    n = t.numel()
    cols = n // _STRIPES
    if cols < 4096:
        return torch.nonzero(t.abs() >= threshold).squeeze(1)
    main = cols * _STRIPES
    grid = t[:main].view(_STRIPES, cols)
    hit = torch.nonzero((grid.amax(dim=0) >= threshold) | (grid.amin(dim=0) <= -threshold))
    hit = hit.squeeze(1)
    rc = torch.nonzero(grid.index_select(1, hit).abs_() >= threshold)
    idx = rc[:, 0].mul_(cols).add_(hit[rc[:, 1]])
    if main < n:
        tail = torch.nonzero(t[main:].abs() >= threshold).squeeze(1).add_(main)
        idx = torch.cat([idx, tail])
    return idx


class TopK(BaseCompressor):
    summable = False
    # gTop-k (Shi et al. 2019): the union of index sets grows along the ring, so each hop
    # keeps the segment's own top k and the loss must go to a +ef residual
    ring_path = "resparsify"
    sparse = True  # sends a few coordinates: ``+ef:momentum`` masks what was sent
    # under SGD momentum, ``+ef`` takes the optimizer's momentum (DGC momentum correction,
    # sparktrain/compress/correction.py): the largest accumulated coordinates go out
    momentum_correction = True

    def __init__(
        self, ratio: float, sampled: bool = False, sample: float = 0.01, warmup: int = 0
    ) -> None:
        self.ratio = float(ratio)
        self.sampled = bool(sampled)
        self.sample = float(sample)
        self.warmup = int(warmup)
        if self.warmup < 0:
            raise ConfigError(f"topk warmup={warmup} must be >= 0 steps (0 = off)")
        extra = ",sampled" if sampled else ""
        if sampled and sample != 0.01:
            extra += f",sample={sample:g}"
        if self.warmup:
            extra += f",warmup={self.warmup}"
        self.spec = f"topk:{self.ratio:g}{extra}"

    def ratio_at(self, step: int) -> float:
        """The keep ratio at bucket step ``step``: the warm-up's exponential decay from
        ``WARMUP_START`` to ``ratio`` over the first ``warmup`` steps, then ``ratio``."""
        if step >= self.warmup or step < 0:
            return self.ratio
        f = step / self.warmup
        return max(self.ratio, WARMUP_START ** (1.0 - f) * self.ratio**f)

    def _indices(self, t: torch.Tensor, k: int, ratio: float, state: BucketState) -> torch.Tensor:
        n = t.numel()
        if not self.sampled or k * 4 >= n:
            return torch.topk(t.abs(), k, sorted=False).indices
        gen = torch.Generator().manual_seed(step_seed(state, 17))
        s = min(n, max(4096, math.ceil(self.sample * n)))
        sample = t[torch.randint(0, n, (s,), generator=gen)].abs_()
        ks = keep_count(ratio, s)
        threshold = torch.topk(sample, ks, sorted=False).values.min()
        idx = above(t, threshold)
        limit = math.ceil(1.25 * k)
        if idx.numel() > limit:
            idx = idx[torch.topk(t[idx].abs_(), limit, sorted=False).indices]
        return idx

    def compress(self, tensor: torch.Tensor, state: BucketState) -> tuple[Payload, Ctx]:
        t = tensor.detach().reshape(-1).to(torch.float32)
        n = t.numel()
        ratio = self.ratio_at(state.step)
        k = keep_count(ratio, n)
        idx = self._indices(t, k, ratio, state) if k else torch.zeros(0, dtype=torch.int64)
        vals = t[idx].contiguous()
        itype = index_dtype(n)
        if itype == np.uint16:  # torch has few uint16 kernels: narrow in numpy (k values)
            indices = idx.to(torch.int32).numpy().astype(np.uint16)
        else:
            indices = idx.to(torch.int32 if itype == np.int32 else torch.int64).numpy()
        return (vals.numpy(), indices), Ctx(n)

    def _parts(self, payload: Payload, ctx: Ctx) -> tuple[torch.Tensor, torch.Tensor]:
        expect_meta(ctx, 0, self.spec)
        expect_parts(payload, (np.float32, index_dtype(ctx.numel)), self.spec)
        vals, idx = payload
        if vals.size != idx.size or vals.size > ctx.numel:
            raise bad(f"{vals.size} values with {idx.size} indices for {ctx.numel} elements")
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= ctx.numel):
            raise bad(f"indices out of range 0..{ctx.numel - 1}")
        return as_tensor(vals), torch.from_numpy(idx.astype(np.int64))

    def decompress(self, payload: Payload, ctx: Ctx) -> torch.Tensor:
        vals, idx = self._parts(payload, ctx)
        out = torch.zeros(ctx.numel, dtype=torch.float32)
        out[idx] = vals
        return out

    def add_into(self, out: torch.Tensor, payload: Payload, ctx: Ctx) -> None:
        vals, idx = self._parts(payload, ctx)
        if out.numel() != ctx.numel:
            raise bad(f"{ctx.numel} elements do not fit a bucket of {out.numel()}")
        out.index_add_(0, idx, vals.to(out.dtype))

    def payload_nbytes(self, numel: int) -> int:
        return keep_count(self.ratio, numel) * (4 + np.dtype(index_dtype(numel)).itemsize)


class RandomK(BaseCompressor):
    summable = True
    parts_summable = True  # equal seeds pick equal indices: the values add
    sparse = True
    # no momentum_correction: random positions leave a coordinate's momentum to build up
    # for about 1/ratio steps, and digits diverges with momentum of either kind
    # (docs/compression.md); randomk wants the optimizer's momentum at 0

    def __init__(self, ratio: float) -> None:
        self.ratio = float(ratio)
        self.spec = f"randomk:{self.ratio:g}"

    def _positions(self, seed: int, n: int) -> torch.Tensor:
        """About k distinct positions (k draws, duplicates dropped): O(k log k), where a
        permutation of n would be O(n). Equal on every rank for the same seed."""
        k = keep_count(self.ratio, n)
        gen = torch.Generator().manual_seed(seed)
        return torch.unique(torch.randint(0, n, (k,), generator=gen))

    def compress(self, tensor: torch.Tensor, state: BucketState) -> tuple[Payload, Ctx]:
        t = tensor.detach().reshape(-1).to(torch.float32)
        seed = step_seed(state, 29)
        vals = t[self._positions(seed, t.numel())].contiguous()
        return (vals.numpy(),), Ctx(t.numel(), (float(seed),))

    def decompress(self, payload: Payload, ctx: Ctx) -> torch.Tensor:
        expect_meta(ctx, 1, self.spec)
        expect_parts(payload, (np.float32,), self.spec)
        seed = ctx.meta[0]
        if seed != int(seed) or not 0 <= seed < 2**52:
            raise bad(f"randomk seed {seed!r}")
        if payload[0].size > keep_count(self.ratio, ctx.numel):
            raise bad(f"{payload[0].size} values, expected {keep_count(self.ratio, ctx.numel)}")
        positions = self._positions(int(seed), ctx.numel)
        if positions.numel() != payload[0].size:
            raise bad(f"{payload[0].size} values for {positions.numel()} positions")
        out = torch.zeros(ctx.numel, dtype=torch.float32)
        out[positions] = as_tensor(payload[0])
        return out

    def payload_nbytes(self, numel: int) -> int:
        return 4 * keep_count(self.ratio, numel)

    def allreduce(
        self, tensor: torch.Tensor, state: BucketState, sum_: SumFn
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return summable_allreduce(self, tensor, state, sum_)


_TOPK_FLAGS = ("sampled", "exact")


def register_all(register: Callable[[str, Callable[[Stage], Any]], None]) -> None:
    def topk(stage: Stage) -> Any:
        check_options(stage, 1, ("ratio", "sample", "warmup"), _TOPK_FLAGS)
        return TopK(
            float_option(stage, "ratio", None, 0.0, 1.0),
            sampled="sampled" in stage.args,
            sample=float_option(stage, "sample", 0.01, 0.0, 1.0),
            warmup=int_option(stage, "warmup", 0, low=0),
        )

    def randomk(stage: Stage) -> Any:
        check_options(stage, 1, ("ratio",), ())
        return RandomK(float_option(stage, "ratio", None, 0.0, 1.0))

    register("topk", topk)
    register("randomk", randomk)
