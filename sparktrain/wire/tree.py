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

Blame. A rank waiting on a partner that is itself waiting (on its folded rank, or on
its partner of an earlier round) would time out at the same moment as that partner and
name it, although the partner is fine and the rank that stopped answering is further
down the chain. So a wait gets ``(1 + PATIENCE_STEP * level)`` timeouts, where
``level`` counts the waits it may depend on: receiving from the folded rank 0, round
``j`` ``j + 1``, a folded rank's wait for the total ``rounds + 1``. The rank next to the
hung one gives up first and its abort notice, which names the hung rank, reaches the
others before their own (longer) deadlines. A partner that dies closes its sockets and
is noticed at once; only a hung one costs the longer waits.

Small messages are sent inline by the calling thread (no thread hand-off). Both
partners send first and then receive, which cannot deadlock while a message fits in
the socket buffers; bigger messages go through the mesh's background sender so that
both directions flow at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np

from sparktrain.errors import CommError
from sparktrain.wire.connection import Connection
from sparktrain.wire.frames import HEADER_BYTES, KIND_DATA, KIND_PAYLOAD
from sparktrain.wire.mesh import Mesh
from sparktrain.wire.ring import AddFn, check_buffer

INLINE_MAX_BYTES = 256 << 10
"""Largest message sent inline; the kernel buffers of a connection hold several MiB."""
PATIENCE_STEP = 0.5
"""Extra timeouts per level of waits a receive may depend on (see the module docstring):
tolerates ranks reaching their waits up to half a timeout apart."""


@contextlib.contextmanager
def _patient(conn: Connection, base: float, level: int) -> Iterator[None]:
    """Let receives on ``conn`` wait ``(1 + PATIENCE_STEP * level)`` times ``base``."""
    if level <= 0:
        yield
        return
    before = conn.timeout
    conn.set_timeout(base * (1.0 + PATIENCE_STEP * level))
    try:
        yield
    finally:
        conn.set_timeout(before)


def tree_raw_bytes_sent(length: int, world_size: int, rank: int, itemsize: int) -> int:
    """Payload bytes ``rank`` sends in one tree allreduce of ``length`` elements."""
    if world_size == 1:
        return 0
    p = 1 << (world_size.bit_length() - 1)
    if rank >= p:
        return length * itemsize
    sends = (p.bit_length() - 1) + (1 if rank + p < world_size else 0)
    return sends * length * itemsize


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

    def allreduce_(
        self, buf: np.ndarray, *, add: AddFn | None = None, kind: int = KIND_DATA
    ) -> None:
        """Sum ``buf`` over all ranks, in place. Every rank must pass the same length.

        ``add`` replaces ``np.add`` (must be commutative); ``kind`` tags the frames.
        """
        check_buffer(buf, custom_add=add is not None)
        mesh = self.mesh
        if mesh.world_size == 1 or buf.size == 0:
            return
        try:
            self._run(buf, np.add if add is None else add, kind)
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

    def allgather(self, blob: np.ndarray, max_bytes: int) -> list[np.ndarray]:
        """Every rank's byte blob (1-D uint8, any length) in rank order, by recursive
        doubling: round j swaps everything gathered so far with ``rank ^ 2**j``; folded
        ranks hand their blob in first and get all blobs back last. Each rank sends
        ``n - 1`` blobs (a folded partner ``2 (n - 1)``)."""
        mesh = self.mesh
        r, p, n = mesh.rank, self.pow2, mesh.world_size
        if n == 1:
            return [blob]
        have: dict[int, np.ndarray] = {r: blob}
        try:
            mesh.connect_all(self._peers())
            rounds = p.bit_length() - 1
            if r >= p:
                conn = mesh.connection(r - p)
                conn.send_array(blob, KIND_PAYLOAD)
                with _patient(conn, mesh.timeout, rounds + 1):
                    for q in range(n):
                        if q != r:
                            have[q] = self._recv_blob(conn, max_bytes)
                return [have[q] for q in range(n)]
            if r + p < n:
                have[r + p] = self._recv_blob(mesh.connection(r + p), max_bytes)
            for j in range(rounds):
                partner = r ^ (1 << j)
                mine = sorted(have)
                theirs = sorted(
                    q
                    for base in range(p)
                    if (base >> j) == (partner >> j)
                    for q in (base, base + p)
                    if q < n
                )
                conn = mesh.connection(partner)
                size = sum(have[q].nbytes + HEADER_BYTES for q in mine)
                sender = None if self._inline(conn, size) else mesh.sender(partner)
                for q in mine:
                    if sender is None:
                        conn.send_array(have[q], KIND_PAYLOAD)
                    else:
                        sender.put(have[q], KIND_PAYLOAD)
                with _patient(conn, mesh.timeout, j + 1):
                    for q in theirs:
                        have[q] = self._recv_blob(conn, max_bytes)
                if sender is not None:
                    sender.flush()
            if r + p < n:
                conn = mesh.connection(r + p)
                for q in range(n):
                    if q != r + p:
                        conn.send_array(have[q], KIND_PAYLOAD)
        except CommError as exc:
            failure = mesh.abort(exc)
            if failure is exc:
                raise
            raise failure from exc
        return [have[q] for q in range(n)]

    def connect(self) -> None:
        """Open the connections to every partner this rank has (before :meth:`swap`)."""
        self.mesh.connect_all(self._peers())

    def swap(self, peer: int, blob: np.ndarray | None, max_bytes: int, level: int) -> np.ndarray:
        """Send ``blob`` (1-D uint8; None: send nothing) to ``peer`` and receive one blob
        from it, waiting ``level`` extra patience steps (see the module docstring). Both
        partners of a round send first, as in :meth:`allreduce_`. Callers catch
        :class:`CommError` and abort the mesh."""
        mesh = self.mesh
        conn = mesh.connection(peer)
        sender = None
        if blob is not None:
            sender = None if self._inline(conn, blob.nbytes) else mesh.sender(peer)
            if sender is None:
                conn.send_array(blob, KIND_PAYLOAD)
            else:
                sender.put(blob, KIND_PAYLOAD)
        with _patient(conn, mesh.timeout, level):
            got = self._recv_blob(conn, max_bytes)
        if sender is not None:
            sender.flush()
        return got

    @staticmethod
    def _recv_blob(conn: Connection, max_bytes: int) -> np.ndarray:
        _, data = conn.recv_bytes(KIND_PAYLOAD, max_bytes=max_bytes)
        return np.frombuffer(data, dtype=np.uint8)

    def _run(self, buf: np.ndarray, add: AddFn, kind: int) -> None:
        mesh = self.mesh
        r, p, n = mesh.rank, self.pow2, mesh.world_size
        rounds = p.bit_length() - 1
        mesh.connect_all(self._peers())
        if r >= p:
            # Extra rank: hand the buffer to the partner, get the total back. Sending
            # first is safe whatever the size: the partner receives before it sends.
            conn = mesh.connection(r - p)
            conn.send_array(buf, kind)
            with _patient(conn, mesh.timeout, rounds + 1):
                conn.recv_into(buf, kind)
            return
        scratch = self._scratch_for(buf)
        folded = r + p < n
        if folded:
            mesh.connection(r + p).recv_into(scratch, kind)
            add(buf, scratch, buf)
        for j in range(rounds):
            conn = mesh.connection(r ^ (1 << j))
            if self._inline(conn, buf.nbytes):
                conn.send_array(buf, kind)
                with _patient(conn, mesh.timeout, j + 1):
                    conn.recv_into(scratch, kind)
            else:
                sender = mesh.sender(conn.peer_rank)
                sender.put(buf, kind)
                with _patient(conn, mesh.timeout, j + 1):
                    conn.recv_into(scratch, kind)
                sender.flush()  # buf is being sent: do not touch it before this
            add(buf, scratch, buf)
        if folded:
            mesh.connection(r + p).send_array(buf, kind)
