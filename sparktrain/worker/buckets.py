"""Gradient fusion: parameters' gradients packed into a few flat buckets per allreduce.

The averaging rule: rank r computes the mean-loss gradient g_r over its n_r samples of
the step (n_r may be 0 when its partition ran out). Each bucket carries n_r * g_r, and
the first bucket one extra slot with n_r; after the SUM allreduce every rank divides by
N = sum(n_r). The result, sum(n_r g_r) / N, is exactly the gradient of the mean loss
over all N samples of the step, however unevenly they were spread.

With compression (:meth:`GradientBuckets.average_compressed_`) the count slot is left
out of what the compressor sees: the reducer carries n_r uncompressed alongside (see
``sparktrain/compress/collective.py``), so N arrives exactly whatever the compressor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import nn

_NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64}


class SumAllreduce(Protocol):
    def allreduce_(self, buf: np.ndarray) -> None: ...


class BucketReducer(Protocol):
    """Sums one bucket's gradients (without the count slot) over the ranks, in place,
    carrying the sample count on the side (e.g. ``CompressedAllreduce``)."""

    def reduce_(
        self,
        index: int,
        grads: torch.Tensor,
        count: float | None,
        *,
        shapes: Sequence[tuple[int, ...]] = (),
        raw_length: int | None = None,
    ) -> float: ...


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    flat: np.ndarray  # what the allreduce sees
    tensor: torch.Tensor  # a torch view of the same memory
    views: list[torch.Tensor]  # per-parameter views into tensor


class GradientBuckets:
    """Preallocated flat buffers that gradients are copied into and out of every step."""

    def __init__(self, params: Sequence[nn.Parameter], bucket_bytes: int) -> None:
        groups: list[list[nn.Parameter]] = []
        size = 0
        for p in params:
            if p.dtype not in _NUMPY_DTYPES:
                raise TypeError(f"parameters of dtype {p.dtype} are not supported; use float32/64")
            nbytes = p.numel() * p.element_size()
            if not groups or size + nbytes > bucket_bytes or groups[-1][0].dtype != p.dtype:
                groups.append([])
                size = 0
            groups[-1].append(p)
            size += nbytes
        self.buckets: list[_Bucket] = []
        for i, group in enumerate(groups):
            extra = 1 if i == 0 else 0  # the sample-count slot
            flat = np.zeros(
                sum(p.numel() for p in group) + extra, dtype=_NUMPY_DTYPES[group[0].dtype]
            )
            tensor = torch.from_numpy(flat)
            views, offset = [], 0
            for p in group:
                views.append(tensor[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
            self.buckets.append(_Bucket(group, flat, tensor, views))

    @property
    def num_elements(self) -> int:
        return sum(b.flat.size for b in self.buckets)

    def average_(self, allreduce: SumAllreduce, count: int) -> float:
        """Replace every gradient by the sample-weighted mean over all ranks; returns N."""
        self._fill(count)
        self.buckets[0].flat[-1] = count
        for b in self.buckets:
            allreduce.allreduce_(b.flat)
        return self._finish(float(self.buckets[0].flat[-1]))

    def average_compressed_(self, reducer: BucketReducer, count: int) -> float:
        """As :meth:`average_`, through a reducer that keeps the count out of the
        compressed payload; returns N."""
        self._fill(count)
        total = 0.0
        for i, b in enumerate(self.buckets):
            got = reducer.reduce_(
                i,
                b.tensor[:-1] if i == 0 else b.tensor,
                float(count) if i == 0 else None,
                shapes=[tuple(p.shape) for p in b.params],
                raw_length=b.flat.size,
            )
            if i == 0:
                total = got
        return self._finish(total)

    def _fill(self, count: int) -> None:
        for b in self.buckets:
            for p, view in zip(b.params, b.views, strict=True):
                if p.grad is None:
                    view.zero_()
                else:
                    view.copy_(p.grad)
            if count != 1:
                b.tensor.mul_(count)

    def _finish(self, total: float) -> float:
        if total <= 0:
            raise RuntimeError("no rank contributed samples to this step")
        for b in self.buckets:
            b.tensor.div_(total)
            for p, view in zip(b.params, b.views, strict=True):
                if p.grad is None:
                    p.grad = view.clone()
                else:
                    p.grad.copy_(view)
        return total
