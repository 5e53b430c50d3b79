"""A model's tensors as raw bytes, and rank 0's trained state streamed to the driver.

A Spark task result is limited by ``spark.driver.maxResultSize`` (1 GiB by default) and
the driver would hold it whole, then copy it into the model: a model of ~268M float32
parameters could not come back at all. Instead rank 0 connects to the driver's
:class:`~sparktrain.launch.state_server.StateReceiver` over the authenticated wire and
sends a JSON layout, then every tensor in pieces of at most ``chunk_bytes``
(:mod:`sparktrain.comm.chunked`); the driver receives each piece straight into its own
model's tensors. No pickle, no full copy on either side: rank 0 sends from the
parameters' memory (a non-contiguous tensor is copied alone).

Protocol (after the handshake; rank 0 dials, the driver is ``DRIVER_RANK``):

1. rank 0 -> driver, ``KIND_CONTROL``: ``{"layout": [{name, dtype, shape, nbytes}],
   "chunk_bytes": c}``;
2. driver -> rank 0, ``KIND_CONTROL``: ``{}`` to go on, or ``{"error": ...}`` (the
   layout does not fit the driver's model);
3. rank 0 -> driver: each tensor's bytes, ``KIND_DATA`` frames of at most ``c`` bytes;
4. driver -> rank 0, ``KIND_CONTROL``: ``{}`` once everything is in place, so the task
   ends only after the driver holds the state.

Executor-side code: never imports pyspark.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch
from torch import nn

from sparktrain.comm.chunked import chunk_bytes_for, send_chunked
from sparktrain.comm.connection import Connection
from sparktrain.comm.frames import KIND_CONTROL
from sparktrain.comm.handshake import DRIVER_RANK, connect
from sparktrain.comm.security import WireSecurity
from sparktrain.comm.stats import CommStats
from sparktrain.errors import WorkerError

LAYOUT_MAX_BYTES = 64 << 20
"""Largest layout message accepted (names, dtypes, shapes: ~100 bytes a tensor)."""


def byte_view(tensor: torch.Tensor) -> np.ndarray:
    """A writable 1-D ``uint8`` numpy view of a contiguous CPU tensor's memory (any dtype,
    bfloat16 and bool included): sending it is bitwise exact, receiving into it writes
    the tensor."""
    if not tensor.is_contiguous():
        raise ValueError("byte_view needs a contiguous tensor")
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    return flat.view(torch.uint8).numpy()


def tensor_layout(state: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    """The JSON description of a state dict: name, dtype, shape and byte size in order."""
    return [
        {
            "name": name,
            "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
            "nbytes": t.numel() * t.element_size(),
        }
        for name, t in state.items()
    ]


def send_state(
    address: str,
    model: nn.Module,
    *,
    secret: bytes,
    job_id: str,
    attempt: int,
    timeout: float,
    chunk_bytes: int,
    security: WireSecurity | None = None,
) -> int:
    """Stream ``model``'s state dict to the driver's state receiver (module docstring);
    returns the payload bytes sent. Raises :class:`WorkerError` if the driver refused
    the layout, :class:`~sparktrain.errors.CommError` if the connection failed."""
    state = model.state_dict()
    with connect(
        address,
        secret=secret,
        job_id=job_id,
        attempt=attempt,
        my_rank=0,
        peer_rank=DRIVER_RANK,
        timeout=timeout,
        stats=CommStats(),
        security=security,
    ) as conn:
        step = chunk_bytes_for(conn.max_frame_bytes, chunk_bytes)
        head = {"layout": tensor_layout(state), "chunk_bytes": step}
        conn.send_bytes(json.dumps(head).encode(), KIND_CONTROL)
        _check_reply(conn)
        sent = 0
        for tensor in state.values():
            # a non-contiguous tensor (rare: e.g. a transposed buffer) is copied alone
            send_chunked(conn, byte_view(tensor.detach().contiguous()), step)
            sent += tensor.numel() * tensor.element_size()
        _check_reply(conn)
    return sent


def _check_reply(conn: Connection) -> None:
    _, raw = conn.recv_bytes(KIND_CONTROL, max_bytes=1 << 16)
    reply = json.loads(raw)
    if "error" in reply:
        raise WorkerError(f"the driver refused rank 0's trained state: {reply['error']}")
