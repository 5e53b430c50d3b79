"""The driver's half of tree_aggregate's compressed weight downloads (``delta+`` specs).

Without ``delta+``, every round ships the full float32 weights to every task (in the
closure or a broadcast): on a slow link that is half of a round's bytes, and the half no
gradient compressor touches. With ``compression="delta+X"`` (``delta+int8``,
``delta+topk:0.01+ef``, ...) the driver sends each round only ``C_X(w - mirror)``, the
compressed change to the copy the tasks already hold, and advances its ``mirror`` by the
decoded message, exactly as the parameter server's pulls do
(:mod:`sparktrain.strategies.ps.protocol`): the tasks compute on ``mirror``, which trails
the driver's weights by the compression error that the next delta re-sends (so the error
never accumulates). Uploads use ``X`` with its ``+ef`` as before.

Python workers keep the mirror between rounds (:mod:`.task`). A worker that ran the
previous round adds the delta; one that did not (a new executor, a worker that sat a
round out) fetches the round's full mirror from the driver's :class:`WeightsServer` over
an authenticated connection (the tasks' half of both, :class:`~.task_weights.Download`
included, is :mod:`.task_weights`). Only such tasks pay the full weights, and only when
they need them: a Spark broadcast would ship them to every executor every round. Sender
and receivers apply the same decoded bytes with the same ops, so every copy of ``mirror``
is bitwise equal and a retried task computes the same contribution.

``delta+powersgd`` is refused (its decode depends on the thread count, so copies would
drift), as for the parameter server: see :func:`~.codec.download_compressor`.
"""

from __future__ import annotations

import json
import logging
import threading

import numpy as np
import torch

from sparktrain.compress.base import BucketState, Compressor, encode_message
from sparktrain.errors import CommError
from sparktrain.strategies.tree_aggregate.task_weights import Download
from sparktrain.wire.chunked import DEFAULT_CHUNK_BYTES, chunk_bytes_for, send_chunked
from sparktrain.wire.connection import Connection
from sparktrain.wire.frames import KIND_CONTROL
from sparktrain.wire.security import WireSecurity
from sparktrain.wire.service import DriverService

log = logging.getLogger(__name__)


class DownloadEncoder:
    """The driver's side: the mirror every task computes on, advanced once a round.
    Without a compressor (``comp=None``: a Spark Connect run whose weights are too large
    for the round's closure) every download is exact and the tasks fetch it."""

    def __init__(self, comp: Compressor | None, seed: int) -> None:
        self.comp = comp
        self.state = BucketState(key=0, seed=seed)
        self.mirror: np.ndarray | None = None
        self.seq = -1

    def next(self, weights: np.ndarray, exact: object = None, *, force: bool = False) -> Download:
        """The download for a round that should compute on ``weights``. The first one
        (or any with ``force``: the final evaluation) carries them exactly, in ``exact``
        (the array for the closure, or their broadcast), and resets the mirror to them;
        ``exact=None``: the tasks fetch this mirror from the server."""
        self.seq += 1
        if self.mirror is None or force or self.comp is None:
            self.mirror = np.array(weights, dtype=np.float32, copy=True)
            return Download(self.seq, weights.size, None, exact)
        delta = torch.from_numpy(weights - self.mirror)
        payload, ctx = self.comp.compress(delta, self.state)
        self.state.step += 1
        self.comp.add_into(torch.from_numpy(self.mirror), payload, ctx)
        return Download(self.seq, weights.size, encode_message(payload, ctx, 0.0))


class WeightsServer(DriverService):
    """Serves the current ``mirror`` to tasks whose Python worker does not hold it."""

    name = "weights"

    def __init__(
        self,
        host: str,
        encoder: DownloadEncoder,
        *,
        secret: bytes,
        job_id: str,
        security: WireSecurity | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        super().__init__(host, secret=secret, job_id=job_id, attempt=0, security=security)
        self._encoder = encoder
        self.chunk_bytes = chunk_bytes  # the mirror goes out in frames of at most this
        # One read-only copy of the current mirror, shared by every fetch of its round
        # (the encoder advances the mirror in place); dropped when the round advances.
        self._snapshot: tuple[int, np.ndarray] | None = None
        self.snapshots = 0  # copies made: one per round that had fetches
        self._lock = threading.Lock()
        self.fetches = 0
        self.start()

    def handle(self, conn: Connection) -> None:
        with conn:
            try:
                _, request = conn.recv_bytes(KIND_CONTROL, max_bytes=1024)
                seq = int(json.loads(request)["seq"])
                with self._lock:
                    enc = self._encoder
                    values = None
                    if seq == enc.seq and enc.mirror is not None:
                        if self._snapshot is None or self._snapshot[0] != seq:
                            self._snapshot = (seq, enc.mirror.copy())
                            self.snapshots += 1
                        values = self._snapshot[1]
                if values is None:
                    reply = {"error": f"mirror {seq} is gone (the driver is at {enc.seq})"}
                    conn.send_bytes(json.dumps(reply).encode(), KIND_CONTROL)
                    return
                # in pieces: a mirror over the frame cap (268M+ parameters) still goes out
                step = chunk_bytes_for(conn.max_frame_bytes, self.chunk_bytes)
                conn.send_bytes(json.dumps({"chunk_bytes": step}).encode(), KIND_CONTROL)
                send_chunked(conn, values, step)
                self.fetches += 1
            except (CommError, OSError, ValueError, KeyError) as exc:
                log.debug("weights server: a fetch failed: %s", exc)

    @property
    def compresses(self) -> bool:
        """Does it send compressed deltas (a ``delta+`` spec), or only exact weights?"""
        return self._encoder.comp is not None

    def next(self, weights: np.ndarray, exact: object = None, *, force: bool = False) -> Download:
        """:meth:`DownloadEncoder.next` under the server's lock."""
        with self._lock:
            self._snapshot = None  # fetches under way keep theirs alive until done
            return self._encoder.next(weights, exact, force=force)
