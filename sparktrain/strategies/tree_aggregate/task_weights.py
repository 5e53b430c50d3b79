"""The tasks' side of tree_aggregate's compressed weight downloads (``delta+`` specs).

With ``compression="delta+X"`` a round's closure carries a :class:`Download` instead of
the weights: ``C_X(mirror[seq] - mirror[seq - 1])``, the compressed change to the
``mirror`` the tasks compute on (the driver's half, with the why, is
:mod:`.driver_weights`). A Python worker that holds ``mirror[seq - 1]`` advances it with
:func:`apply_delta`; one that does not fetches ``mirror[seq]`` whole from the driver's
``WeightsServer`` with :func:`fetch_mirror`. Sender and receivers apply the same decoded
bytes with the same ops, so every copy of ``mirror`` is bitwise equal.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from sparktrain.compress.base import Compressor, decode_message
from sparktrain.errors import CommError
from sparktrain.wire.chunked import recv_chunked_into
from sparktrain.wire.frames import KIND_CONTROL
from sparktrain.wire.handshake import DRIVER_RANK, connect
from sparktrain.wire.security import WireSecurity
from sparktrain.wire.stats import CommStats


@dataclass(frozen=True)
class Download:
    """What a round's closure carries instead of the weights (``delta+`` specs).

    ``message`` is ``C(mirror[seq] - mirror[seq - 1])`` (an ``encode_message`` buffer),
    or ``None`` when the mirror restarts from the exact weights in ``first`` (the first
    round, and the final evaluation, whose metric is then the driver model's own). With
    neither (weights too large for a Spark Connect closure) the tasks fetch ``mirror[seq]``
    from the driver's weights server.
    """

    seq: int
    numel: int
    message: np.ndarray | None
    first: Any = None  # the exact first weights: an array or a broadcast of one


def apply_delta(comp: Compressor, ref: np.ndarray, message: np.ndarray) -> None:
    """Advance a copy of the mirror by one download's message, in place."""
    parts, ctx, _ = decode_message(message, ref.size)
    comp.add_into(torch.from_numpy(ref), parts, ctx)


def fetch_mirror(
    address: str, *, secret: bytes, job_id: str, partition: int, seq: int, numel: int,
    timeout: float, security: WireSecurity | None = None,
) -> np.ndarray:  # fmt: skip
    """A task's side: the driver's ``mirror[seq]`` as a fresh float32 array."""
    with connect(
        address,
        secret=secret,
        job_id=job_id,
        attempt=0,
        my_rank=partition,
        peer_rank=DRIVER_RANK,
        timeout=timeout,
        stats=CommStats(),
        security=security,
    ) as conn:
        conn.send_bytes(json.dumps({"seq": seq}).encode(), KIND_CONTROL)
        _, status = conn.recv_bytes(KIND_CONTROL, max_bytes=4096)
        reply = json.loads(status)
        if "error" in reply:
            raise CommError(f"partition {partition}: the driver's weights server: {reply['error']}")
        step = int(reply.get("chunk_bytes", conn.max_frame_bytes))
        if not 0 < step <= conn.max_frame_bytes:
            raise CommError(f"partition {partition}: the weights server sent a bad chunk size")
        out = np.empty(numel, dtype=np.float32)
        recv_chunked_into(conn, out, step)
    return out
