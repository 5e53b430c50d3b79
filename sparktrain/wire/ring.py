"""Bandwidth-optimal ring allreduce (reduce-scatter, then all-gather).

Each rank sends to ``rank + 1`` and receives from ``rank - 1``. The buffer is split
into ``world_size`` balanced segments; in ``world_size - 1`` reduce-scatter steps
every segment travels once around the ring picking up each rank's contribution, and
in ``world_size - 1`` all-gather steps the finished segments travel around once more
and are copied. Each rank sends ``2 (n - 1) / n`` of the buffer: the minimum.

Segments are pipelined in chunks of at most ``chunk_bytes``. A background sender
thread keeps the outgoing socket busy while the calling thread receives the next
chunk into a preallocated scratch buffer and adds it in place, so sending, receiving
and adding overlap (socket calls and numpy ufuncs release the GIL). The hot loop
allocates nothing but small view objects. Buffers of at most ``INLINE_MAX_BYTES / 2``
are sent by the calling thread instead: there, the thread hand-off would cost more
than the transfer.

Every rank ends with the same bytes: each segment's sum is computed by exactly one
rank (in a fixed order around the ring) and then copied verbatim to the others.

The two halves are also callable on their own (``shard_optimizer``, ZeRO-1):
:meth:`RingAllreduce.reduce_scatter_` leaves rank ``r`` with the finished sum of segment
``r + 1`` (the same bytes the allreduce gives), :meth:`RingAllreduce.allgather_` copies
every rank's segment ``r + 1`` to the others.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from sparktrain.errors import CommError, ConfigError
from sparktrain.wire.frames import HEADER_BYTES, KIND_DATA, KIND_PAYLOAD
from sparktrain.wire.mesh import Mesh

AddFn = Callable[[np.ndarray, np.ndarray, np.ndarray], object]
"""``add(a, b, out)``: element-wise ``out = a + b``; must be commutative and
deterministic (the default is ``np.add``)."""

SUMMABLE_DTYPES = (np.float16, np.float32, np.float64)

DEFAULT_CHUNK_BYTES = 4 << 20
INLINE_MAX_BYTES = 512 << 10
"""Largest exchange (2x the buffer) sent by the calling thread instead of the sender."""


def check_buffer(buf: np.ndarray, custom_add: bool = False) -> None:
    """Raise ConfigError unless ``buf`` is a 1-D, C-contiguous float16/32/64 array (any
    dtype when the caller brings its own ``add``)."""
    if not isinstance(buf, np.ndarray):
        raise ConfigError(f"allreduce_ needs a numpy array, got {type(buf).__name__}")
    if buf.ndim != 1 or not buf.flags.c_contiguous or not buf.flags.writeable:
        raise ConfigError(
            "allreduce_ needs a writable, 1-D, C-contiguous buffer "
            f"(got shape {buf.shape}); flatten gradients into one bucket first"
        )
    if not custom_add and buf.dtype not in SUMMABLE_DTYPES:
        raise ConfigError(
            f"allreduce_ supports float16, float32 and float64 buffers, got {buf.dtype}; "
            "pass add= for other dtypes"
        )


def ring_segments(length: int, world_size: int) -> list[tuple[int, int]]:
    """The ``[start, stop)`` element ranges of the ring's segments (sizes differ by <= 1)."""
    return [(k * length // world_size, (k + 1) * length // world_size) for k in range(world_size)]


def ring_raw_bytes_sent(length: int, world_size: int, rank: int, itemsize: int) -> int:
    """Payload bytes ``rank`` sends in one ring allreduce of ``length`` elements.

    Reduce-scatter sends every segment but ``rank + 1``'s, all-gather every segment but
    ``rank + 2``'s: about ``2 (n - 1) / n`` of the buffer.
    """
    if world_size == 1:
        return 0
    segs = ring_segments(length, world_size)

    def size(k: int) -> int:
        start, stop = segs[k % world_size]
        return stop - start

    return (2 * length - size(rank + 1) - size(rank + 2)) * itemsize


def ring_allgather(
    mesh: Mesh, blob: np.ndarray, max_bytes: int, kind: int = KIND_PAYLOAD
) -> list[np.ndarray]:
    """Every rank's ``blob`` (1-D uint8, any length), in rank order, around the ring.

    ``n - 1`` steps; each rank sends its own blob and forwards ``n - 2`` others, so it
    sends ``n - 1`` blobs in all. Blobs longer than ``max_bytes`` are refused unread.
    Large sends go through the mesh's background sender, so the ring cannot deadlock.
    """
    n, r = mesh.world_size, mesh.rank
    blobs: list[np.ndarray | None] = [None] * n
    blobs[r] = blob
    if n == 1:
        return [blob]
    nxt, prv = (r + 1) % n, (r - 1) % n
    try:
        mesh.connect_all((nxt, prv))
        send_conn, recv = mesh.connection(nxt), mesh.connection(prv)
        sender = None
        for step in range(n - 1):
            out = blobs[(r - step) % n]
            assert out is not None
            if sender is None and out.nbytes + HEADER_BYTES > min(
                INLINE_MAX_BYTES, send_conn.send_buffer_bytes // 4
            ):
                sender = mesh.sender(nxt)
            if sender is None:
                send_conn.send_array(out, kind)
            else:
                sender.put(out, kind)
            _, data = recv.recv_bytes(kind, max_bytes=max_bytes)
            blobs[(r - step - 1) % n] = np.frombuffer(data, dtype=np.uint8)
        if sender is not None:
            sender.flush()
    except CommError as exc:
        failure = mesh.abort(exc)
        if failure is exc:
            raise
        raise failure from exc
    return [b for b in blobs if b is not None]


class RingAllreduce:
    """In-place SUM allreduce over a ring of ranks; best for large buffers."""

    name = "ring"

    def __init__(self, mesh: Mesh, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        if chunk_bytes < 8:
            raise ConfigError(f"ring chunk_bytes must be >= 8, got {chunk_bytes}")
        self.mesh = mesh
        self.chunk_bytes = int(chunk_bytes)
        self._scratch: dict[np.dtype, np.ndarray] = {}
        self._plans: dict[tuple[int, int], list[list[tuple[int, int]]]] = {}

    def _chunks(self, length: int, itemsize: int) -> list[list[tuple[int, int]]]:
        """Per segment, its chunks as ``[start, stop)`` element ranges (cached)."""
        key = (length, itemsize)
        plan = self._plans.get(key)
        if plan is None:
            step = max(1, self.chunk_bytes // itemsize)
            plan = [
                [(a, min(a + step, stop)) for a in range(start, stop, step)]
                for start, stop in ring_segments(length, self.mesh.world_size)
            ]
            if len(self._plans) > 64:
                self._plans.clear()
            self._plans[key] = plan
        return plan

    def _scratch_for(self, dtype: np.dtype, elements: int) -> np.ndarray:
        scratch = self._scratch.get(dtype)
        if scratch is None or scratch.size < elements:
            scratch = np.empty(elements, dtype=dtype)
            self._scratch[dtype] = scratch
        return scratch

    def allreduce_(
        self, buf: np.ndarray, *, add: AddFn | None = None, kind: int = KIND_DATA
    ) -> None:
        """Sum ``buf`` over all ranks, in place. Every rank must pass the same length.

        ``add`` replaces ``np.add`` (e.g. bfloat16 held in int16); ``kind`` tags the
        frames (``KIND_PAYLOAD`` for compressed buffers: not counted as raw bytes).
        """
        check_buffer(buf, custom_add=add is not None)
        mesh = self.mesh
        n = mesh.world_size
        if n == 1 or buf.size == 0:
            return
        self._guarded(lambda: self._ring(buf, np.add if add is None else add, kind))

    def allgather(self, blob: np.ndarray, max_bytes: int) -> list[np.ndarray]:
        """Every rank's byte blob in rank order (see :func:`ring_allgather`)."""
        return ring_allgather(self.mesh, blob, max_bytes)

    def reduce_scatter_(self, buf: np.ndarray, *, kind: int = KIND_DATA) -> tuple[int, int]:
        """The first half of :meth:`allreduce_`: afterwards this rank's
        :meth:`owned_segment` of ``buf`` holds the sum over all ranks (the rest of
        ``buf`` holds partial sums). Returns that segment's ``[start, stop)``.

        The sum of each segment is the same bytes :meth:`allreduce_` would give."""
        check_buffer(buf)
        segment = ring_segments(buf.size, self.mesh.world_size)[self.owned_segment()]
        if self.mesh.world_size == 1 or buf.size == 0:
            return segment
        self._guarded(lambda: self._ring(buf, np.add, kind, scatter=True, gather=False))
        return segment

    def allgather_(self, buf: np.ndarray, *, kind: int = KIND_DATA) -> None:
        """The second half of :meth:`allreduce_`: every rank's :meth:`owned_segment` of
        ``buf`` is copied to all the others, so every rank ends with the same bytes."""
        check_buffer(buf)
        if self.mesh.world_size == 1 or buf.size == 0:
            return
        self._guarded(lambda: self._ring(buf, np.add, kind, scatter=False, gather=True))

    def owned_segment(self, rank: int | None = None) -> int:
        """The index (into :func:`ring_segments`) of the segment whose sum ``rank``
        (default this rank) finishes in the reduce-scatter: its successor's, ``rank + 1``."""
        n = self.mesh.world_size
        return ((self.mesh.rank if rank is None else rank) + 1) % n

    def _guarded(self, run: Callable[[], None]) -> None:
        try:
            run()
        except CommError as exc:
            # Tear the mesh down so the neighbours fail now rather than at their
            # timeout, and raise the first failure (the rank really lost).
            failure = self.mesh.abort(exc)
            if failure is exc:
                raise
            raise failure from exc

    def _ring(
        self, buf: np.ndarray, add: AddFn, kind: int, *, scatter: bool = True, gather: bool = True
    ) -> None:
        """Reduce-scatter and/or all-gather ``buf``; both (the allreduce) pipeline the
        last reduce-scatter send into the first all-gather step."""
        mesh = self.mesh
        n, r = mesh.world_size, mesh.rank
        nxt, prv = (r + 1) % n, (r - 1) % n
        mesh.connect_all((nxt, prv))
        recv = mesh.connection(prv)
        send_conn = mesh.connection(nxt)
        plan = self._chunks(buf.size, buf.itemsize)
        biggest = max((b - a for seg in plan for a, b in seg), default=0)
        scratch = self._scratch_for(buf.dtype, biggest) if scatter else buf[:0]
        recv_into = recv.recv_into
        # Small buffers: send from this thread, skipping the hand-off to the sender
        # thread (tens of microseconds per wake-up). Safe from deadlock because a rank
        # can run ahead of its successor by at most the whole exchange, 2x the buffer,
        # which then sits in the socket buffers. The frames are the same either way,
        # so ranks need not agree on the choice.
        frames = sum(len(seg) for seg in plan)
        inline = 2 * (buf.nbytes + HEADER_BYTES * frames) <= min(
            INLINE_MAX_BYTES, send_conn.send_buffer_bytes // 4
        )
        sender = None if inline else mesh.sender(nxt)
        put = send_conn.send_array if sender is None else sender.put
        last = n - 2

        if scatter:
            # Reduce-scatter. Step 0 sends this rank's own segment; from then on every
            # chunk goes out as soon as it has been reduced here, which pipelines the
            # steps. The chunk finished in the last step is this rank's fully reduced
            # segment r+1: sending it is the first all-gather step (only when
            # gathering too).
            for a, b in plan[r]:
                put(buf[a:b], kind)
            for step in range(n - 1):
                for a, b in plan[(r - step - 1) % n]:
                    view = buf[a:b]
                    tmp = scratch[: b - a]
                    recv_into(tmp, kind)
                    add(view, tmp, view)
                    if gather or step < last:
                        put(view, kind)
        elif gather:
            # A separate all-gather starts by sending the segment this rank owns.
            for a, b in plan[(r + 1) % n]:
                put(buf[a:b], kind)
        if gather:
            # All-gather: finished segments arrive straight into place and are passed
            # on, except in the last step, when the segment has been everywhere else.
            # Overwriting buf here is safe even while our own earlier sends of the same
            # chunk may still be queued: the finished chunk includes this rank's
            # contribution, so it cannot arrive before the successor has read that send.
            for step in range(n - 1):
                for a, b in plan[(r - step) % n]:
                    view = buf[a:b]
                    recv_into(view, kind)
                    if step < last:
                        put(view, kind)
        # The caller may modify buf as soon as we return: wait for the sends.
        if sender is not None:
            sender.flush()
