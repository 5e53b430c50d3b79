"""A model's tensors as raw bytes: replicas started from one rank's weights, a digest of
them, and trained state streamed to the driver.

A Spark task result is limited by ``spark.driver.maxResultSize`` (1 GiB by default) and
the driver would hold it whole, then copy it into the model: a model of ~268M float32
parameters could not come back at all. Instead rank 0 connects to the driver's
:class:`~sparktrain.driver.services.state_receiver.StateReceiver` over the authenticated wire and
sends a JSON layout, then every tensor in pieces of at most ``chunk_bytes``
(:mod:`sparktrain.wire.chunked`); the driver receives each piece straight into its own
model's tensors. No pickle, no full copy on either side: rank 0 sends from the
parameters' memory (a non-contiguous tensor is copied alone). Under pipeline
parallelism several ranks send, each its own part of the model (one stage's tensors,
under the whole model's key names); the receiver knows which rank sends which keys.

Protocol (after the handshake; the sending rank dials, the driver is ``DRIVER_RANK``):

1. rank -> driver, ``KIND_CONTROL``: ``{"layout": [{name, dtype, shape, nbytes}],
   "chunk_bytes": c}``;
2. driver -> rank, ``KIND_CONTROL``: ``{}`` to go on, or ``{"error": ...}`` (the
   layout does not fit the driver's model, or this rank sends no state);
3. rank -> driver: each tensor's bytes, ``KIND_DATA`` frames of at most ``c`` bytes;
4. driver -> rank, ``KIND_CONTROL``: ``{}`` once everything is in place, so the task
   ends only after the driver holds the state.

Executor-side code: never imports pyspark.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from sparktrain.errors import WorkerError
from sparktrain.result import Record, state_records
from sparktrain.task.context import JobSpec
from sparktrain.wire import DRIVER_RANK, KIND_CONTROL, CommStats, Connection, Mesh, connect
from sparktrain.wire.chunked import broadcast_, chunk_bytes_for, send_chunked
from sparktrain.wire.security import WireSecurity

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


def start_from_rank0(model: nn.Module, mesh: Mesh, chunk_bytes: int) -> int:
    """Every replica starts from rank 0's parameters and buffers, as DDP does when it
    wraps a model (``mesh`` may be a group's view: its rank 0, e.g. a pipeline stage's
    replica 0). Seeding torch's global RNG before the build is not enough: another
    thread of the same process drawing from that RNG meanwhile gives this rank other
    initial weights (measured: 44 of 100 thread-harness runs diverged with a thread
    calling ``torch.rand``; CI saw it once in a full suite).

    A chunked broadcast of each tensor's own bytes down a binomial tree
    (:func:`~sparktrain.wire.chunked.broadcast_`): bitwise exact for every dtype, no
    frame larger than ``chunk_bytes`` (so any model size), and no copy of the model —
    each piece lands in the parameter itself. Returns the bytes this rank received."""
    tensors = [*model.parameters(), *model.buffers()]
    views, fixups = [], []
    for t in tensors:
        if t.is_contiguous() and t.device.type == "cpu":
            views.append(byte_view(t))
        else:  # strided or on a GPU: receive into a host copy of this tensor, copy back
            tmp = t.detach().cpu().contiguous()
            views.append(byte_view(tmp))
            fixups.append((t, tmp))
    received = broadcast_(mesh, views, chunk_bytes)
    with torch.no_grad():
        for t, tmp in fixups:
            t.copy_(tmp)
    return received


def digest(tensors: Iterable[torch.Tensor]) -> str:
    """A short hash of the tensors' bytes: equal on two replicas exactly when their
    weights are bitwise equal."""
    h = hashlib.sha256()
    for t in tensors:
        # the memory itself: no copy (a GPU tensor's comes to the host first)
        h.update(byte_view(t.detach().cpu().contiguous()).data)
    return h.hexdigest()[:16]


def tensor_layout(state: Mapping[str, torch.Tensor]) -> list[dict[str, Any]]:
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
    state: Mapping[str, torch.Tensor],
    *,
    rank: int = 0,
    secret: bytes,
    job_id: str,
    attempt: int,
    timeout: float,
    chunk_bytes: int,
    security: WireSecurity | None = None,
) -> int:
    """Stream the named tensors ``state`` (a model's whole state dict, or one pipeline
    stage's part under the whole model's key names) from ``rank`` to the driver's state
    receiver (module docstring); returns the payload bytes sent. Raises
    :class:`WorkerError` if the driver refused the layout or the rank,
    :class:`~sparktrain.errors.CommError` if the connection failed."""
    with connect(
        address,
        secret=secret,
        job_id=job_id,
        attempt=attempt,
        my_rank=rank,
        peer_rank=DRIVER_RANK,
        timeout=timeout,
        stats=CommStats(),
        security=security,
    ) as conn:
        step = chunk_bytes_for(conn.max_frame_bytes, chunk_bytes)
        head = {"layout": tensor_layout(state), "chunk_bytes": step}
        conn.send_bytes(json.dumps(head).encode(), KIND_CONTROL)
        _check_reply(conn, rank)
        sent = 0
        for tensor in state.values():
            # a non-contiguous tensor (rare: e.g. a transposed buffer) is copied alone
            send_chunked(conn, byte_view(tensor.detach().contiguous()), step)
            sent += tensor.numel() * tensor.element_size()
        _check_reply(conn, rank)
    return sent


def return_state(
    job: JobSpec, rank: int, state: Mapping[str, torch.Tensor], meta: dict[str, Any]
) -> list[Record]:
    """A rank's trained state (or its part of it) for the driver: streamed to the job's
    state receiver when it has one (any size, no copy; :func:`send_state`), else as
    chunked task results (:func:`~sparktrain.result.state_records`). The ``meta`` record
    (``meta``'s keys, plus ``"streamed": true`` and the bytes sent when streamed) is a
    task result either way."""
    if job.state_address is None:
        return list(state_records(rank, state.items(), meta, job.state_chunk_bytes))
    sent = send_state(
        job.state_address,
        state,
        rank=rank,
        secret=job.secret,
        job_id=job.job_id,
        attempt=job.attempt,
        timeout=job.config.comm_timeout,
        chunk_bytes=job.state_chunk_bytes,
        security=job.security,
    )
    streamed = {"streamed": True, **meta, "nbytes": sent}
    return [Record(rank, "meta", 0, json.dumps(streamed).encode())]


def _check_reply(conn: Connection, rank: int) -> None:
    _, raw = conn.recv_bytes(KIND_CONTROL, max_bytes=1 << 16)
    reply = json.loads(raw)
    if "error" in reply:
        raise WorkerError(f"the driver refused rank {rank}'s trained state: {reply['error']}")
