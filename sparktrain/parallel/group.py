"""Collectives over a sub-group of a mesh's ranks (e.g. the D replicas of one stage).

:class:`GroupMesh` is a thin view of a :class:`~sparktrain.wire.mesh.Mesh`: group rank
``g`` is world rank ``members[g]``. It offers exactly what the ring and tree allreduces
and the compressed collectives use (``rank``, ``world_size``, ``stats``,
``max_frame_bytes``, ``connection``, ``connect_all``, ``sender``, ``abort``), so
:class:`~sparktrain.wire.ring.RingAllreduce` and the chunked broadcast run on the group
unchanged. Connections are the mesh's own (opened lazily per pair);
a failure aborts the whole mesh, as it should: one lost rank stops the job.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, cast

from torch import nn

from sparktrain.compress.collective import CompressedAllreduce
from sparktrain.compress.registry import build as build_compressor
from sparktrain.errors import CommError, ConfigError
from sparktrain.task.buckets import GradientBuckets
from sparktrain.wire import Mesh, RingAllreduce
from sparktrain.wire.chunked import DEFAULT_CHUNK_BYTES, chunk_bytes_for
from sparktrain.wire.connection import Connection
from sparktrain.wire.mesh import AsyncSender
from sparktrain.wire.stats import CommStats


class GroupMesh:
    """A view of ``mesh`` restricted to the world ranks ``members`` (in group order)."""

    def __init__(self, mesh: Mesh, members: Sequence[int]) -> None:
        members = list(members)
        if mesh.rank not in members:
            raise ConfigError(f"rank {mesh.rank} is not a member of the group {members}")
        if len(set(members)) != len(members):
            raise ConfigError(f"group members must be distinct, got {members}")
        self.mesh = mesh
        self.members = members
        self.rank = members.index(mesh.rank)
        self.world_size = len(members)

    @property
    def stats(self) -> CommStats:
        return self.mesh.stats

    @property
    def max_frame_bytes(self) -> int:
        return self.mesh.max_frame_bytes

    def world(self, group_rank: int) -> int:
        return self.members[group_rank]

    def connection(self, peer: int) -> Connection:
        return self.mesh.connection(self.members[peer])

    def connect_all(self, peers: Iterable[int]) -> None:
        self.mesh.connect_all([self.members[p] for p in peers])

    def sender(self, peer: int) -> AsyncSender:
        return self.mesh.sender(self.members[peer])

    def abort(self, cause: CommError) -> CommError:
        return self.mesh.abort(cause)

    def as_mesh(self) -> Mesh:
        """This view typed as a Mesh, for the collectives (they use only the API above)."""
        return cast(Mesh, self)


def group_allreduce(mesh: Mesh, members: Sequence[int]) -> RingAllreduce:
    """A ring SUM allreduce over ``members`` of ``mesh`` (pieces under its frame cap)."""
    chunk = max(8, chunk_bytes_for(mesh.max_frame_bytes, DEFAULT_CHUNK_BYTES))
    return RingAllreduce(GroupMesh(mesh, members).as_mesh(), chunk_bytes=chunk)


class GroupGradientSync:
    """Sample-weighted gradient averaging over a group (``task/buckets.py`` rule), with
    ``compression`` (any spec the data-parallel ring accepts) or without."""

    def __init__(
        self,
        mesh: Mesh,
        members: Sequence[int],
        params: Sequence[nn.Parameter],
        bucket_bytes: int,
        compression: str = "none",
        seed: int = 0,
        compression_path: str = "auto",
    ) -> None:
        self.buckets = GradientBuckets(params, bucket_bytes)
        self.allreduce = group_allreduce(mesh, members)
        comp = build_compressor(compression)
        self.compressed = (
            CompressedAllreduce(comp, self.allreduce, seed=seed, path=compression_path)
            if comp is not None
            else None
        )

    def average_(self, count: int) -> float:
        """Replace every gradient by the group's sample-weighted mean; returns the group's
        total sample count."""
        if self.compressed is not None:
            return self.buckets.average_compressed_(self.compressed, count)
        return self.buckets.average_(self.allreduce, count)

    def rank_state(self) -> dict[str, Any] | None:
        """This rank's compressor state (residuals, PowerSGD's ``Q``, ...) for a
        checkpoint shard, or None without compression."""
        if self.compressed is None:
            return None
        return {"compress": self.compressed.state_dict()}

    def load_rank_state(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`rank_state`'s output of the same rank."""
        if self.compressed is not None and "compress" in state:
            self.compressed.load_state_dict(state["compress"])
