"""Latency-optimal allreduce by recursive doubling; best for small buffers.

With ``p = 2**k <= n`` ranks, round ``j`` pairs rank ``r`` with ``r ^ 2**j``; both
exchange their whole buffer and add. After ``k`` rounds every rank holds the sum: log2
rounds of one message each, instead of the ring's ``2 (n - 1)`` steps.

Worlds that are not a power of two fold the extra ranks in first: rank ``p + i``
sends its buffer to rank ``i``, which adds it; after the power-of-two part, rank ``i``
sends the result back.

Bitwise agreement: IEEE addition is commutative, so in each round both partners
compute the same bits (``a + b == b + a``); partners start each round with identical
bits (by induction), and folded ranks receive a verbatim copy. Only NaN payloads may
differ, which does not matter for training.

Small messages are sent inline by the calling thread (no thread hand-off). Both
partners send first and then receive, which cannot deadlock while a message fits in
the socket buffers; bigger messages go through the mesh's background sender so that
both directions flow at once.
"""

from __future__ import annotations

import numpy as np

from sparktrain.comm.ring import check_buffer
from sparktrain.comm.wire import HEADER_BYTES, KIND_DATA, Connection, Mesh
from sparktrain.errors import CommError

INLINE_MAX_BYTES = 256 << 10
"""Largest message sent inline; the kernel buffers of a connection hold several MiB."""


class TreeAllreduce:
    """In-place SUM allreduce by recursive doubling (with folding for odd worlds)."""

    name = "tree"

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh
        n = mesh.world_size
        self.pow2 = 1 << (n.bit_length() - 1)  # largest power of two <= n
        self._scratch: dict[np.dtype, np.ndarray] = {}

    def _peers(self) -> list[int]:
        r, p, n = self.mesh.rank, self.pow2, self.mesh.world_size
        if r >= p:
            return [r - p]
        peers = [r ^ (1 << j) for j in range(p.bit_length() - 1)]
        if r + p < n:
            peers.append(r + p)
        return peers

    def _scratch_for(self, buf: np.ndarray) -> np.ndarray:
        scratch = self._scratch.get(buf.dtype)
        if scratch is None or scratch.size < buf.size:
            scratch = np.empty(buf.size, dtype=buf.dtype)
            self._scratch[buf.dtype] = scratch
        return scratch[: buf.size]

    def allreduce_(self, buf: np.ndarray) -> None:
        """Sum ``buf`` over all ranks, in place. Every rank must pass the same length."""
        check_buffer(buf)
        mesh = self.mesh
        if mesh.world_size == 1 or buf.size == 0:
            return
        try:
            self._run(buf)
        except CommError as exc:
            # Tear the mesh down so the neighbours fail now rather than at their
            # timeout, and raise the first failure (the rank really lost).
            failure = mesh.abort(exc)
            if failure is exc:
                raise
            raise failure from exc

    def _inline(self, conn: Connection, nbytes: int) -> bool:
        # Both partners send before receiving: safe while the message fits in the
        # socket buffers (send buffer here plus receive buffer there).
        limit = min(INLINE_MAX_BYTES, conn.send_buffer_bytes // 4)
        return nbytes + HEADER_BYTES <= limit

    def _run(self, buf: np.ndarray) -> None:
        mesh = self.mesh
        r, p, n = mesh.rank, self.pow2, mesh.world_size
        mesh.connect_all(self._peers())
        if r >= p:
            # Extra rank: hand the buffer to the partner, get the total back. Sending
            # first is safe whatever the size: the partner receives before it sends.
            conn = mesh.connection(r - p)
            conn.send_array(buf, KIND_DATA)
            conn.recv_into(buf, KIND_DATA)
            return
        scratch = self._scratch_for(buf)
        folded = r + p < n
        if folded:
            mesh.connection(r + p).recv_into(scratch, KIND_DATA)
            np.add(buf, scratch, out=buf)
        for j in range(p.bit_length() - 1):
            conn = mesh.connection(r ^ (1 << j))
            if self._inline(conn, buf.nbytes):
                conn.send_array(buf, KIND_DATA)
                conn.recv_into(scratch, KIND_DATA)
            else:
                sender = mesh.sender(conn.peer_rank)
                sender.put(buf, KIND_DATA)
                conn.recv_into(scratch, KIND_DATA)
                sender.flush()  # buf is being sent: do not touch it before this
            np.add(buf, scratch, out=buf)
        if folded:
            mesh.connection(r + p).send_array(buf, KIND_DATA)
