"""Gradient fusion: parameters' gradients packed into a few flat buckets per allreduce.

The averaging rule: rank r computes the mean-loss gradient g_r over its n_r samples of
the step (n_r may be 0 when its partition ran out). Each bucket carries n_r * g_r, and
bucket 0 one extra slot with n_r; after the SUM allreduce every rank divides by
N = sum(n_r). The result, sum(n_r g_r) / N, is exactly the gradient of the mean loss
over all N samples of the step, however unevenly they were spread.

Bucket order: buckets are built in *reverse* parameter order, as torch's DDP does,
because backward produces gradients last layer first: bucket 0 holds the last layers,
is the first one complete during backward, and is the first one reduced. Every rank
reduces bucket 0, 1, 2, ... in that order, overlap on or off, so the collectives match.

Compression: a bucket never mixes compression specs (``specs`` gives one per parameter,
see :mod:`sparktrain.compress.policy`); a compressed bucket goes through a
:class:`BucketReducer` (``sparktrain/compress/collective.py``) that keeps the count out
of what the compressor sees and carries n_r uncompressed alongside, so N arrives exactly
whatever the compressor. The count slot exists only when bucket 0 is uncompressed; a
compressed bucket 0 hands n_r to its reducer instead. Every reducer is also given n_r
with the first bucket it sees in a step, because error feedback keeps its residual per
sample and so must know n_r (its summed count is then ignored: N comes from bucket 0).

:class:`GradientReadiness` registers ``register_post_accumulate_grad_hook`` on every
parameter and reports a group of parameters (a bucket, a parameter-server shard) as
soon as all of its gradients are final in the current backward pass: the hook that
lets the exchange start while backward continues.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
from torch import nn

if TYPE_CHECKING:
    from sparktrain.task.staging import DeviceStaging

_NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64}

NONE = "none"
"""The spec of an uncompressed bucket."""


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
    index: int
    spec: str
    params: list[nn.Parameter]
    flat: np.ndarray  # what the allreduce sees
    tensor: torch.Tensor  # a torch view of the same memory
    views: list[torch.Tensor]  # per-parameter views into tensor
    count_slot: bool  # the last element carries n_r (bucket 0, uncompressed)

    @property
    def grads(self) -> torch.Tensor:
        """The gradient elements, without the count slot."""
        return self.tensor[:-1] if self.count_slot else self.tensor


class GradientBuckets:
    """Preallocated flat buffers that gradients are copied into and out of every step.

    ``specs`` (one per parameter, default all ``"none"``) keeps parameters of different
    compression specs in different buckets. Within a spec, consecutive parameters (in
    reverse order) share a bucket up to ``bucket_bytes``.
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        bucket_bytes: int,
        specs: Sequence[str] | None = None,
        host_alloc: Callable[[int, torch.dtype], torch.Tensor] | None = None,
    ) -> None:
        specs = [NONE] * len(params) if specs is None else list(specs)
        if len(specs) != len(params):
            raise ValueError(f"{len(specs)} compression specs for {len(params)} parameters")
        groups: list[tuple[str, list[nn.Parameter]]] = []
        size = 0
        for p, spec in zip(reversed(params), reversed(specs), strict=True):
            if p.dtype not in _NUMPY_DTYPES:
                raise TypeError(f"parameters of dtype {p.dtype} are not supported; use float32/64")
            nbytes = p.numel() * p.element_size()
            if (
                not groups
                or size + nbytes > bucket_bytes
                or groups[-1][1][0].dtype != p.dtype
                or groups[-1][0] != spec
            ):
                groups.append((spec, []))
                size = 0
            groups[-1][1].append(p)
            size += nbytes
        self.buckets: list[_Bucket] = []
        for i, (spec, group) in enumerate(groups):
            slot = i == 0 and spec == NONE
            numel = sum(p.numel() for p in group) + int(slot)
            if host_alloc is None:
                flat = np.zeros(numel, dtype=_NUMPY_DTYPES[group[0].dtype])
                tensor = torch.from_numpy(flat)
            else:  # pinned host memory that a device copies to and from
                tensor = host_alloc(numel, group[0].dtype)
                flat = tensor.numpy()
            views, offset = [], 0
            for p in group:
                views.append(tensor[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
            self.buckets.append(_Bucket(i, spec, group, flat, tensor, views, slot))
        self._count = 0
        self._weight: float = 0
        self._counted: set[int] = set()  # reducers that were told n_r this step
        # parameters on a GPU: their gradients come and go through device staging
        self.staging: DeviceStaging | None = None

    @property
    def num_elements(self) -> int:
        return sum(b.flat.size for b in self.buckets)

    @property
    def specs(self) -> list[str]:
        """Each bucket's compression spec, in reduction order."""
        return [b.spec for b in self.buckets]

    def bind_grads(self) -> None:
        """Make every parameter's ``.grad`` a view into its bucket (DDP's
        ``gradient_as_bucket_view``): backward then accumulates straight into the
        buckets, so they are not a second copy of the gradients (a model's worth of
        memory, and two copies of it per step). Keep gradients with
        ``zero_grad(set_to_none=False)``; a gradient set to ``None`` or replaced later is
        copied in and out as before."""
        with torch.no_grad():
            for b in self.buckets:
                for p, view in zip(b.params, b.views, strict=True):
                    if p.grad is not None:
                        view.copy_(p.grad)
                    else:
                        view.zero_()
                    p.grad = view

    def begin(self, count: int, micro: int = 1) -> None:
        """Start a step whose gradients stand for ``count`` samples of this rank, held as
        the sum of ``micro`` micro-batch means (accumulation): each bucket carries
        ``count * sum / micro``, so every rank turns its own sum back into one mean
        before the exchange and all ranks receive the same average."""
        self._count = count
        self._weight = count / micro if micro > 1 else count
        self._counted = set()

    def exchange(
        self, index: int, plain: SumAllreduce, reducer: BucketReducer | None = None
    ) -> float | None:
        """Fill bucket ``index`` from the gradients and sum it over the ranks (through
        ``reducer`` when given, else ``plain``). Returns N for bucket 0, else None.

        Call for every bucket in index order on every rank (after :meth:`begin`).
        """
        b = self.buckets[index]
        self.fill(b)
        if reducer is None:
            if b.count_slot:
                b.flat[-1] = self._count
            plain.allreduce_(b.flat)
            return float(b.flat[-1]) if b.count_slot else None
        first = id(reducer) not in self._counted
        self._counted.add(id(reducer))
        got = reducer.reduce_(
            index,
            b.grads,
            float(self._count) if index == 0 or first else None,
            shapes=[tuple(p.shape) for p in b.params],
            raw_length=b.flat.size + int(index == 0 and not b.count_slot),
        )
        return got if index == 0 else None

    def average_(self, allreduce: SumAllreduce, count: int) -> float:
        """Replace every gradient by the sample-weighted mean over all ranks; returns N."""
        self.begin(count)
        totals = [self.exchange(i, allreduce) for i in range(len(self.buckets))]
        assert totals[0] is not None
        return self.finish(totals[0])

    def average_compressed_(self, reducer: BucketReducer, count: int) -> float:
        """As :meth:`average_`, every bucket through a reducer that keeps the count out
        of the compressed payload; returns N."""
        self.begin(count)
        totals = [self.exchange(i, _NoPlain(), reducer) for i in range(len(self.buckets))]
        assert totals[0] is not None
        return self.finish(totals[0])

    def fill(self, b: _Bucket) -> None:
        """Copy the gradients into bucket ``b`` (unless bound there) and weigh them by
        this rank's count of the step (see :meth:`begin`)."""
        if self.staging is not None:
            self.staging.to_host(b.index)
            if self._weight != 1:
                b.tensor.mul_(self._weight)
            return
        for p, view in zip(b.params, b.views, strict=True):
            if p.grad is None:
                view.zero_()
            elif not _is_view(p.grad, view):  # bound gradients are already in place
                view.copy_(p.grad)
        if self._weight != 1:
            b.tensor.mul_(self._weight)

    def finish(self, total: float) -> float:
        """Divide the summed buckets by N = ``total`` and write them to the gradients."""
        if total <= 0:
            raise RuntimeError("no rank contributed samples to this step")
        for b in self.buckets:
            b.tensor.div_(total)
            if self.staging is not None:
                self.staging.to_device(b.index)
                continue
            for p, view in zip(b.params, b.views, strict=True):
                if p.grad is None:
                    p.grad = view.clone()
                elif not _is_view(p.grad, view):
                    p.grad.copy_(view)
        return total


def _is_view(grad: torch.Tensor, view: torch.Tensor) -> bool:
    """Is ``grad`` the bucket's own view (see :meth:`GradientBuckets.bind_grads`)?"""
    return grad.data_ptr() == view.data_ptr() and grad.shape == view.shape


class _NoPlain:
    """The plain allreduce of :meth:`GradientBuckets.average_compressed_`: never used."""

    def allreduce_(self, buf: np.ndarray) -> None:
        raise AssertionError("every bucket has a reducer here")


class GradientReadiness:
    """Reports groups of parameters whose gradients are final in the current backward.

    ``groups[g]`` lists the parameters group ``g`` waits for (a parameter may belong to
    several groups, e.g. one cut by a parameter-server shard boundary). Between
    :meth:`arm` and :meth:`disarm`, ``on_ready(g)`` is called (from the thread running
    backward, inside the autograd hook) once each group's last gradient has been
    accumulated. Outside that window the hooks do nothing, so other backward passes
    (evaluation, tests) are unaffected. A second gradient for a parameter within one
    armed step (two backward passes) would arrive after its group was handed off: it is
    recorded and :meth:`disarm` raises, rather than silently dropping a contribution.
    """

    def __init__(
        self, groups: Sequence[Sequence[nn.Parameter]], on_ready: Callable[[int], None]
    ) -> None:
        self._on_ready = on_ready
        self._member_of: dict[int, list[int]] = {}
        params: dict[int, nn.Parameter] = {}
        for g, group in enumerate(groups):
            for p in group:
                params[id(p)] = p
                member = self._member_of.setdefault(id(p), [])
                if g not in member:
                    member.append(g)
        self._need = [len({id(p) for p in group}) for group in groups]
        self._left = list(self._need)
        self._seen: set[int] = set()
        self._armed = False
        self._twice: str | None = None
        self._lock = threading.Lock()
        self._handles: list[Any] = [
            p.register_post_accumulate_grad_hook(self._hook) for p in params.values()
        ]

    def arm(self) -> None:
        """Start watching a new backward pass."""
        with self._lock:
            self._left = list(self._need)
            self._seen = set()
            self._twice = None
            self._armed = True

    def disarm(self) -> None:
        """Stop watching; raises if a parameter got two gradients while armed."""
        with self._lock:
            self._armed = False
            twice = self._twice
        if twice is not None:
            raise RuntimeError(
                f"a parameter of shape {twice} received a second gradient in one step after "
                "its bucket was already being exchanged (backward ran twice between "
                "begin_step and step); accumulate gradients with overlap=false"
            )

    def _hook(self, p: torch.Tensor) -> None:
        ready: list[int] = []
        with self._lock:
            if not self._armed:
                return
            if id(p) in self._seen:
                self._twice = str(tuple(p.shape))
                return
            self._seen.add(id(p))
            for g in self._member_of.get(id(p), ()):
                self._left[g] -= 1
                if self._left[g] == 0:
                    ready.append(g)
        for g in ready:
            self._on_ready(g)

    def remove(self) -> None:
        """Unregister the hooks; idempotent."""
        for h in self._handles:
            h.remove()
        self._handles = []
