"""Transfers that never depend on the payload fitting one frame.

A frame carries at most the connection's ``max_frame_bytes`` (1 GiB by default), but a
model, an activation batch or a partition's rows may be larger. The helpers here split
an array into consecutive pieces of at most ``chunk_bytes`` (and never more than the
frame cap), send each piece from the array's own memory and receive each straight into
its place in a preallocated array: no pickle, no intermediate copy, any size.

Sender and receiver must split alike: both call :func:`pieces` on arrays of the same
dtype and element count with the same ``chunk_bytes`` (the frame's shape is not
checked, only its dtype and byte length).

:func:`broadcast_` sends rank 0's arrays to every rank down a binomial tree, chunk by
chunk, in the arrays' own dtype: what every replica needs to start from rank 0's model.

Executor-side code: never imports pyspark (nor torch).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from sparktrain.errors import CommError, ConfigError
from sparktrain.wire.connection import Connection
from sparktrain.wire.frames import KIND_DATA
from sparktrain.wire.mesh import AsyncSender, Mesh

DEFAULT_CHUNK_BYTES = 4 << 20
"""Pieces of this size keep the pipe full without large per-frame buffers anywhere."""


def chunk_bytes_for(max_frame_bytes: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """The piece size to use under a frame cap: ``min(chunk_bytes, max_frame_bytes)``."""
    size = min(chunk_bytes, max_frame_bytes)
    if size <= 0:
        raise ConfigError(f"chunk size must be > 0 bytes, got {size}")
    return size


def pieces(arr: np.ndarray, chunk_bytes: int) -> Iterator[np.ndarray]:
    """Consecutive 1-D views of a C-contiguous ``arr``, each at most ``chunk_bytes``
    (at least one element each); nothing for an empty array."""
    if not arr.flags.c_contiguous:
        raise ConfigError("chunked transfers need a C-contiguous array")
    flat = arr.reshape(-1)
    step = max(1, chunk_bytes // max(1, arr.itemsize))
    for start in range(0, flat.size, step):
        yield flat[start : start + step]


def send_chunked(conn: Connection, arr: np.ndarray, chunk_bytes: int, kind: int = KIND_DATA) -> int:
    """Send ``arr`` as frames of at most ``chunk_bytes``; returns the number of frames."""
    frames = 0
    for piece in pieces(arr, chunk_bytes):
        conn.send_array(piece, kind)
        frames += 1
    return frames


def put_chunked(
    sender: AsyncSender, arr: np.ndarray, chunk_bytes: int, kind: int = KIND_DATA
) -> None:
    """Queue ``arr`` on a background sender in pieces; ``arr`` must stay untouched until
    the sender's ``flush`` (the pieces are views of it)."""
    for piece in pieces(arr, chunk_bytes):
        sender.put(piece, kind)


def recv_chunked_into(
    conn: Connection, out: np.ndarray, chunk_bytes: int, kind: int = KIND_DATA
) -> None:
    """Receive what :func:`send_chunked` sent straight into ``out`` (C-contiguous,
    writable, same dtype and element count as the sender's array)."""
    if not out.flags.writeable:
        raise ConfigError("recv_chunked_into needs a writable array")
    for piece in pieces(out, chunk_bytes):
        conn.recv_into(piece, kind)


def tree_parent(rank: int) -> int | None:
    """Rank 0's binomial tree: ``rank``'s parent (it clears the highest set bit)."""
    return None if rank == 0 else rank - (1 << (rank.bit_length() - 1))


def tree_children(rank: int, world_size: int) -> list[int]:
    """Rank 0's binomial tree: the ranks ``rank`` forwards to, biggest subtree first."""
    first = rank.bit_length()  # children set one bit above the highest bit of rank
    out = []
    bit = first
    while rank + (1 << bit) < world_size:
        out.append(rank + (1 << bit))
        bit += 1
    return out[::-1]


def broadcast_(
    mesh: Mesh,
    arrays: Sequence[np.ndarray],
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    kind: int = KIND_DATA,
) -> int:
    """Overwrite ``arrays`` on every rank with rank 0's, bitwise, in their own dtypes.

    Every rank passes arrays of the same dtypes and sizes (C-contiguous, writable).
    Pieces of at most ``min(chunk_bytes, mesh.max_frame_bytes)`` travel down a binomial
    tree rooted at rank 0: each rank receives a piece from its parent straight into the
    array and queues it to its children (background senders) before receiving the
    next, so the pieces are pipelined and the largest extra buffer is none at all.
    ``log2(n)`` hops deep; rank 0 sends ``len(children)`` copies. Returns the bytes
    this rank received. A failure aborts the mesh and raises the first
    :class:`~sparktrain.errors.CommError`.
    """
    step = chunk_bytes_for(mesh.max_frame_bytes, chunk_bytes)
    rank, n = mesh.rank, mesh.world_size
    if n == 1:
        return 0
    parent = tree_parent(rank)
    children = tree_children(rank, n)
    received = 0
    try:
        mesh.connect_all([*children, *([] if parent is None else [parent])])
        senders = [mesh.sender(c) for c in children]
        upstream = None if parent is None else mesh.connection(parent)
        for arr in arrays:
            if upstream is not None and not arr.flags.writeable:
                raise ConfigError("broadcast_ needs writable arrays on the receiving ranks")
            for piece in pieces(arr, step):
                if upstream is not None:
                    upstream.recv_into(piece, kind)
                    received += piece.nbytes
                for sender in senders:
                    sender.put(piece, kind)
        for sender in senders:
            sender.flush()
    except CommError as exc:
        failure = mesh.abort(exc)
        if failure is exc:
            raise
        raise failure from exc
    return received


class PiecewiseAllreduce:
    """An allreduce run on consecutive pieces of the buffer, each at most ``max_bytes``.

    For algorithms that send a whole buffer per message (the tree): a bucket larger
    than the frame cap (one huge embedding is one bucket) is summed piece by piece.
    Element-wise sums are unchanged, so the result is bitwise what one call gives.
    """

    def __init__(self, algo: Any, max_bytes: int) -> None:
        self.algo = algo
        self.name = str(algo.name)
        self.max_bytes = chunk_bytes_for(max_bytes, max_bytes)

    def allreduce_(self, buf: np.ndarray) -> None:
        """Sum ``buf`` over all ranks, in place, piece by piece."""
        if buf.nbytes <= self.max_bytes:
            self.algo.allreduce_(buf)
            return
        for piece in pieces(buf, self.max_bytes):
            self.algo.allreduce_(piece)
