"""``powersgd:R``: rank-R power iteration (Vogels et al. 2019), as torch's PowerSGD hook.

Each matrix ``M`` (``rows x cols``; parameters of 2+ dims are viewed as
``shape[0] x rest``) is approximated by ``P Q^T`` with ``P = orth(M Q)``,
``Q = M^T P``. ``Q`` is kept per bucket in the state and reused next step (warm start;
``powersgd:R,cold`` redraws it each step from a seed shared by all ranks). Vectors and
matrices too small to gain (``R (rows + cols) >= rows * cols``) travel uncompressed.
A bucket without parameter shapes is treated as one near-square matrix.

Summable, in two rounds (the path taken on ring/tree): SUM ``M_r Q`` over ranks (plus
the uncompressed values), orthogonalise the sum on every rank (identical input, identical
bits), then SUM ``M_r^T P``. The total is ``P (sum_r M_r^T P)^T``, and rank r's own
share ``P P^T M_r`` is what error feedback subtracts. Bytes: ``R (rows + cols)`` floats
per matrix instead of ``rows * cols``, reduced inside the ring at ``2 (n - 1) / n``.

``compress``/``decompress`` are the single-round form for all-gather, parameter server
and treeAggregate (each sender orthogonalises its own ``P``; payload ``P``, ``Q`` and the
uncompressed values; the ctx carries the layout). Error bound: the rank-R truncation
error of each matrix (exact for matrices of rank <= R).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
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
    expect_len,
    expect_parts,
)
from sparktrain.compress.spec import Stage, check_options, int_option

Q_SLOT = "powersgd.q"


@dataclass(frozen=True)
class _Mat:
    offset: int
    rows: int
    cols: int


def _layout(shapes: tuple[tuple[int, ...], ...], numel: int, rank: int) -> list[_Mat]:
    """The matrices to compress within a bucket of ``numel`` values."""
    if shapes and sum(math.prod(s) for s in shapes) == numel:
        mats, offset = [], 0
        for s in shapes:
            size = math.prod(s)
            if len(s) >= 2:
                rows, cols = s[0], size // max(s[0], 1)
                if rank * (rows + cols) < rows * cols:
                    mats.append(_Mat(offset, rows, cols))
            offset += size
        return mats
    rows = math.isqrt(numel)
    if rows == 0:
        return []
    cols = numel // rows
    if rank * (rows + cols) >= rows * cols:
        return []
    return [_Mat(0, rows, cols)]  # the tail past rows*cols travels uncompressed


def _rest_mask(mats: list[_Mat], numel: int) -> torch.Tensor:
    """Positions of the values that travel uncompressed (the gaps between matrices)."""
    gaps, pos = [], 0
    for m in mats:
        if m.offset > pos:
            gaps.append(torch.arange(pos, m.offset))
        pos = m.offset + m.rows * m.cols
    if numel > pos:
        gaps.append(torch.arange(pos, numel))
    return torch.cat(gaps) if gaps else torch.zeros(0, dtype=torch.int64)


def _orth(p: torch.Tensor) -> torch.Tensor:
    return torch.linalg.qr(p, mode="reduced").Q if p.numel() else p


class PowerSGD(BaseCompressor):
    summable = True
    deterministic_decode = False  # a matrix product: its bits depend on the thread count

    ddp_hook = "powersgd"
    ddp_hook_feedback = True

    def ddp_hook_options(self) -> dict[str, Any]:
        return {"rank": self.rank, "warm_start": self.warm}

    def __init__(self, rank: int, warm: bool = True) -> None:
        self.rank = int(rank)
        self.warm = bool(warm)
        self.spec = f"powersgd:{self.rank}" + ("" if warm else ",cold")

    def _qs(self, state: BucketState, mats: list[_Mat]) -> list[torch.Tensor]:
        qs = state.slots.get(Q_SLOT)
        shapes = [(m.cols, min(self.rank, m.rows, m.cols)) for m in mats]
        if not self.warm or qs is None or [tuple(q.shape) for q in qs] != shapes:
            seed = state.seed * 7919 + state.key + (0 if self.warm else state.step * 104_729)
            gen = torch.Generator().manual_seed(seed)
            qs = [torch.randn(s, generator=gen) for s in shapes]
            state.slots[Q_SLOT] = qs
        return qs

    def allreduce(
        self, tensor: torch.Tensor, state: BucketState, sum_: SumFn
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = tensor.detach().reshape(-1).to(torch.float32)
        n = x.numel()
        mats = _layout(state.shapes, n, self.rank)
        qs = self._qs(state, mats)
        ms = [x[m.offset : m.offset + m.rows * m.cols].view(m.rows, m.cols) for m in mats]
        rest = _rest_mask(mats, n)
        # round 1: M Q for every matrix, plus the uncompressed values
        p_sizes = [m.rows * q.shape[1] for m, q in zip(mats, qs, strict=True)]
        round1 = torch.empty(sum(p_sizes) + rest.numel(), dtype=torch.float32)
        pos = 0
        for mat, q, size in zip(ms, qs, p_sizes, strict=True):
            torch.mm(mat, q, out=round1[pos : pos + size].view(mat.shape[0], q.shape[1]))
            pos += size
        round1[pos:] = x[rest]
        sum_(round1.numpy())
        ps, pos = [], 0
        for mat, q, size in zip(ms, qs, p_sizes, strict=True):
            ps.append(_orth(round1[pos : pos + size].view(mat.shape[0], q.shape[1])))
            pos += size
        # round 2: M^T P
        q_sizes = [q.numel() for q in qs]
        round2 = torch.empty(sum(q_sizes), dtype=torch.float32)
        local = torch.empty(n, dtype=torch.float32)
        local[rest] = x[rest]
        pos = 0
        for m, mat, p, size in zip(mats, ms, ps, q_sizes, strict=True):
            mine = round2[pos : pos + size].view(m.cols, p.shape[1])
            torch.mm(mat.t(), p, out=mine)
            local[m.offset : m.offset + m.rows * m.cols] = (p @ mine.t()).reshape(-1)
            pos += size
        if round2.numel():
            sum_(round2.numpy())
        total = torch.empty(n, dtype=torch.float32)
        total[rest] = round1[sum(p_sizes) :]
        pos, new_qs = 0, []
        for m, p, size in zip(mats, ps, q_sizes, strict=True):
            q_sum = round2[pos : pos + size].view(m.cols, p.shape[1])
            total[m.offset : m.offset + m.rows * m.cols] = (p @ q_sum.t()).reshape(-1)
            new_qs.append(q_sum.clone())
            pos += size
        state.slots[Q_SLOT] = new_qs
        return total, local

    # single-round form -------------------------------------------------------------
    def compress(self, tensor: torch.Tensor, state: BucketState) -> tuple[Payload, Ctx]:
        x = tensor.detach().reshape(-1).to(torch.float32)
        n = x.numel()
        mats = _layout(state.shapes, n, self.rank)
        qs = self._qs(state, mats)
        p_parts, q_parts = [], []
        for m, q in zip(mats, qs, strict=True):
            mat = x[m.offset : m.offset + m.rows * m.cols].view(m.rows, m.cols)
            p = _orth(mat @ q)
            q_new = mat.t() @ p
            p_parts.append(p.reshape(-1))
            q_parts.append(q_new.reshape(-1))
        if self.warm and mats:
            state.slots[Q_SLOT] = [
                qp.view(m.cols, -1).clone() for m, qp in zip(mats, q_parts, strict=True)
            ]
        cat = torch.cat
        empty = torch.zeros(0)
        dims = (float(v) for m in mats for v in (m.offset, m.rows, m.cols))
        meta = (float(self.rank), *dims)
        payload = (
            cat(p_parts).numpy() if p_parts else empty.numpy(),
            cat(q_parts).numpy() if q_parts else empty.numpy(),
            x[_rest_mask(mats, n)].contiguous().numpy(),
        )
        return payload, Ctx(n, meta)

    def decompress(self, payload: Payload, ctx: Ctx) -> torch.Tensor:
        if not isinstance(ctx, Ctx) or len(ctx.meta) % 3 != 1 or ctx.numel < 0:
            raise bad(f"powersgd ctx must carry the rank and 3 numbers per matrix, got {ctx!r}")
        if not all(v == int(v) and 0 <= v < 2**53 for v in ctx.meta):
            raise bad("powersgd ctx numbers must be whole and >= 0")
        expect_parts(payload, (np.float32, np.float32, np.float32), self.spec)
        r = int(ctx.meta[0])
        n = ctx.numel
        mats = [_Mat(*(int(v) for v in ctx.meta[i : i + 3])) for i in range(1, len(ctx.meta), 3)]
        end = 0
        for m in mats:
            if m.offset < end or m.offset + m.rows * m.cols > n:
                raise bad("powersgd matrices overlap or exceed the bucket")
            end = m.offset + m.rows * m.cols
        ranks = [min(r, m.rows, m.cols) for m in mats]
        expect_len(payload[0], sum(m.rows * k for m, k in zip(mats, ranks, strict=True)), "P")
        expect_len(payload[1], sum(m.cols * k for m, k in zip(mats, ranks, strict=True)), "Q")
        rest = _rest_mask(mats, n)
        expect_len(payload[2], rest.numel(), "the uncompressed values")
        out = torch.empty(n, dtype=torch.float32)
        out[rest] = as_tensor(payload[2])
        p_all, q_all = as_tensor(payload[0]), as_tensor(payload[1])
        pp = qp = 0
        for m, k in zip(mats, ranks, strict=True):
            p = p_all[pp : pp + m.rows * k].view(m.rows, k)
            q = q_all[qp : qp + m.cols * k].view(m.cols, k)
            out[m.offset : m.offset + m.rows * m.cols] = (p @ q.t()).reshape(-1)
            pp += m.rows * k
            qp += m.cols * k
        return out

    def payload_nbytes(self, numel: int) -> int:
        mats = _layout((), numel, self.rank)
        return 4 * (numel - sum(m.rows * m.cols for m in mats)) + sum(
            4 * self.rank * (m.rows + m.cols) for m in mats
        )


def register_all(register: Callable[[str, Callable[[Stage], Any]], None]) -> None:
    def factory(stage: Stage) -> Any:
        check_options(stage, 1, ("rank",), ("cold", "warm"))
        return PowerSGD(int_option(stage, "rank", 1, low=1), warm="cold" not in stage.args)

    register("powersgd", factory)
