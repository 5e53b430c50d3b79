"""The allreduce protocol and the registry of algorithms, chosen by name."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np

from sparktrain.errors import ConfigError
from sparktrain.wire.mesh import Mesh
from sparktrain.wire.ring import RingAllreduce
from sparktrain.wire.tree import TreeAllreduce


@runtime_checkable
class Allreduce(Protocol):
    """An in-place SUM allreduce over the ranks of a :class:`Mesh`.

    ``allreduce_(buf)`` takes a 1-D, C-contiguous float32 or float64 buffer of the same
    length on every rank (any length, including 0 and 1) and leaves the element-wise
    sum over all ranks in it, bitwise identical on every rank. A communication failure
    raises a :class:`~sparktrain.errors.CommError` (usually ``PeerLostError`` naming the
    lost rank) and aborts the mesh.
    """

    name: str

    def allreduce_(self, buf: np.ndarray) -> None: ...


ALLREDUCE_ALGOS: dict[str, type] = {
    RingAllreduce.name: RingAllreduce,
    TreeAllreduce.name: TreeAllreduce,
}
"""Allreduce algorithms by name: ``ring`` (large buffers), ``tree`` (small buffers)."""


def make_allreduce(name: str, mesh: Mesh, **options: Any) -> Allreduce:
    """Build the allreduce algorithm called ``name`` on ``mesh``.

    ``options`` go to the algorithm's constructor (e.g. ``chunk_bytes`` for ``ring``).
    """
    cls = ALLREDUCE_ALGOS.get(name)
    if cls is None:
        allowed = ", ".join(sorted(ALLREDUCE_ALGOS))
        raise ConfigError(f"unknown allreduce algorithm {name!r}: choose one of {allowed}")
    try:
        algo: Allreduce = cls(mesh, **options)
    except TypeError as exc:
        raise ConfigError(f"bad options {sorted(options)} for allreduce {name!r}: {exc}") from exc
    return algo
