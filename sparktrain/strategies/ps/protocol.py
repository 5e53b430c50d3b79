"""The parameter server's messages: fixed struct headers plus raw array payloads.

Every exchange is a request from a worker and one reply from a shard, on an
authenticated :class:`~sparktrain.wire.connection.Connection` (handshake with the job secret,
job id and stage attempt; the worker dials with ``peer_rank=DRIVER_RANK``). Headers are
small struct-packed ``send_bytes`` frames of their own kind; arrays travel as
``KIND_DATA`` frames (``send_array``/``recv_into``). Never pickle.

======  =====================================================  ==========================
kind    header                                                  followed by
======  =====================================================  ==========================
PUSH    job tag, attempt, rank, step, count, version, payload,  the gradient (if payload),
        payload bytes, chunk bytes                              in chunks
ACK     status, lost rank, shard version                        a text frame if not OK
PULL    attempt, rank, step, version the worker holds          -
REPLY   status, lost rank, version, encoding, elements,         the delta or values, in
        payload bytes, chunk bytes                              chunks; a text frame if
                                                                not OK
BYE     attempt, rank, clean                                    -
ROWS    table, rows                                             the row ids (int64), then
                                                                the rows, in chunks
RPULL   attempt, rank, table, rows                              the row ids (int64), in
                                                                chunks
RREPLY  status, lost rank, rows, chunk bytes                    the rows, in chunks; a
                                                                text frame if not OK
======  =====================================================  ==========================

Sparse embedding tables (``sparse_embeddings="auto"``, docs/sparse_ps.md): each table
built with ``sparse=True`` is split by rows over the shards
(:func:`~sparktrain.strategies.ps.layout.row_ranges`) and left out of the flat vector. A push
with samples is followed, after its dense payload and before the ACK, by one ``ROWS``
message per table: the shard-local ids (ascending, each once) of the rows the step
touched and their gradient rows. ``RPULL`` asks for the current values of named rows
(shard-local ids) and is answered at once (``RREPLY``): in sync mode the rank's
previous pull already waited for its step, and the shard cannot apply another before
this rank pushes again.

Chunks: no payload depends on fitting one frame (``MAX_FRAME_BYTES_DEFAULT`` caps a
frame at 1 GiB; a float32 shard of a 300M-parameter model is more). A payload of
``payload bytes`` travels as consecutive frames of ``chunk bytes`` each (the last one
shorter), which the receiver reads straight into the matching slices of its buffer
(:func:`send_chunked`/:func:`recv_chunked`). The sender picks the chunk size (at most
its frame cap, see :func:`chunk_size`) and names it in the header, so the two ends
never have to agree on it beforehand; a chunk above the receiver's cap is refused with
a clear error. The server names its chunk size in every reply and the workers push
with it.

``step`` counts a rank's steps from 0 over the whole run (the global step: a stage
retry or a resumed run continues the count, so the server's per-rank record of the
last step it accepted tells a resent push from a new one, across reconnections,
stage attempts and driver restarts). ``count`` is the number of
samples behind the gradient; a push with count 0 carries no payload. A push is
identified by (job, attempt, rank, step): the job and the attempt are proven by the
handshake and repeated in the header, so a push from an older stage attempt is
rejected even on a connection that somehow survived; a duplicate step is acknowledged
and not applied again.

Pulls are delta-encoded. The shard keeps, per rank, an exact mirror of the copy that
rank holds. A pull whose version equals the shard's costs one header (``UNCHANGED``);
otherwise the shard sends ``delta = params - mirror`` and adds the same delta to the
mirror, so both ends do the same float operations and stay bit-identical (the worker
is at most one rounding away from the server's parameters, never drifting). Without a
compressor a delta is as large as the values, so in sync mode exact pulls send the
values themselves (``FULL``) from the shard's memory, with no mirror: they cannot change
before the pulling rank pushes its next step.

Compression (``config.compression``, see :func:`make_compression`):

* **pushes** go through the gradient part of the spec (``int8+ef``, ``topk:0.01+ef``...;
  the error-feedback residual lives in the worker, one per shard). The payload is one
  :func:`~sparktrain.compress.base.encode_message` buffer in a ``KIND_CPAYLOAD`` frame;
  the shard decodes it and accumulates ``count * D(payload)`` exactly as before.
* **pulls** are compressed only with a ``delta+`` prefix (``delta+int8``,
  ``delta+topk:0.01+ef``): the shard sends ``C(params - mirror)`` (encoding
  ``CDELTA``), decodes its own message and adds it to the mirror with
  ``Compressor.add_into``; the worker adds the same decoded bytes to its copy with the
  same op, so mirror and copy stay bit-identical. What compression leaves out stays in
  ``params - mirror`` and goes out with the next pull: the mirror *is* the error
  feedback (no ``+ef`` needed, none applied). Without ``delta+`` pulls stay exact fp32
  deltas: compressing the parameters themselves (not their change) would lose
  precision for good, and sparsifying them would zero most weights.
* ``delta+powersgd`` is refused for pulls: its decode is a matrix product whose bits
  may depend on the thread count, which would break the bit-identical mirror.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from sparktrain.compress.base import (
    BucketState,
    Compressor,
    decode_message,
    encode_message,
)
from sparktrain.compress.feedback import ability
from sparktrain.compress.registry import build, split_spec
from sparktrain.errors import ConfigError, FrameError
from sparktrain.wire.connection import Connection
from sparktrain.wire.frames import HEADER_BYTES, KIND_DATA, KIND_USER_MIN

KIND_PUSH = KIND_USER_MIN
KIND_ACK = KIND_USER_MIN + 1
KIND_PULL = KIND_USER_MIN + 2
KIND_REPLY = KIND_USER_MIN + 3
KIND_BYE = KIND_USER_MIN + 4
KIND_TEXT = KIND_USER_MIN + 5
KIND_CPAYLOAD = KIND_USER_MIN + 6
"""A compressed push or pull message: counted as wire bytes only (the sender adds the
uncompressed equivalent to ``raw_bytes_sent`` itself)."""
KIND_ROWS = KIND_USER_MIN + 7
KIND_RPULL = KIND_USER_MIN + 8
KIND_RREPLY = KIND_USER_MIN + 9

# job tag, attempt, rank, step, count, version, has payload, payload bytes, chunk bytes,
# learning rate (NaN: the server's own; else the worker's schedule sets the step's rate)
PUSH = struct.Struct("<QqqqqqBqqd")
ACK = struct.Struct("<Biq")  # status, lost rank, version
PULL = struct.Struct("<qqqq")  # attempt, rank, step (-1: before the first), version held
# status, lost rank, version, encoding, elements, payload bytes, chunk bytes
REPLY = struct.Struct("<BiqBqqq")
BYE = struct.Struct("<qqB")  # attempt, rank, clean (1: finished, 0: failed)
ROWS = struct.Struct("<qq")  # table, rows (then ids and rows, if any)
RPULL = struct.Struct("<qqqq")  # attempt, rank, table, rows (then the ids)
RREPLY = struct.Struct("<Biqq")  # status, lost rank, rows, chunk bytes (then the rows)

MAX_HEADER_BYTES = 128
CHUNK_BYTES_DEFAULT = 64 << 20
"""Payload bytes per frame unless a smaller frame cap or an injected size says less:
well under the 1 GiB frame cap, large enough that per-frame costs vanish."""
MAX_TEXT_BYTES = 4096

# statuses
OK = 0
DUPLICATE = 1
"""The push was seen before: acknowledged, not applied again."""
STALE_ATTEMPT = 2
"""The push or pull comes from an earlier stage attempt: rejected."""
WRONG_JOB = 3
LOST = 4
"""A rank was lost (or missed the timeout): the run cannot go on; names the rank."""
PROTOCOL = 5
"""An out-of-order or malformed request."""
STOPPED = 6
"""The server is shutting down."""

STATUS_NAMES = {
    OK: "ok",
    DUPLICATE: "duplicate",
    STALE_ATTEMPT: "stale attempt",
    WRONG_JOB: "wrong job",
    LOST: "lost rank",
    PROTOCOL: "protocol error",
    STOPPED: "stopped",
}

# pull encodings
UNCHANGED = 0
"""Header only: the worker holds the shard's current version."""
DELTA = 1
"""The payload is ``params - mirror``; the worker adds it to its copy."""
FULL = 2
"""The payload is the values (first pull, or a worker that lost track)."""
CDELTA = 3
"""The payload is a compressed ``params - mirror`` message (``delta+`` specs)."""

NO_RANK = -2  # "lost rank" field when no rank is to blame


def job_tag(job_id: str) -> int:
    """A 64-bit tag of the job id carried in every push."""
    return int.from_bytes(hashlib.sha256(job_id.encode("utf-8")).digest()[:8], "little")


def chunk_size(frame_cap: int, wanted: int | None = None, itemsize: int = 4) -> int:
    """Bytes per chunk: ``wanted`` (default :data:`CHUNK_BYTES_DEFAULT`) but at most
    ``frame_cap``, rounded down to whole items of ``itemsize`` bytes (8 covers both
    float dtypes and the uint8 compressed messages)."""
    size = min(wanted if wanted is not None else CHUNK_BYTES_DEFAULT, frame_cap)
    if size < itemsize:
        raise ConfigError(
            f"a parameter-server chunk of {size} bytes cannot hold one {itemsize}-byte "
            "element; raise the chunk size or the frame cap"
        )
    return size - size % itemsize


def send_chunked(conn: Connection, arr: np.ndarray, kind: int, chunk_bytes: int) -> int:
    """Send the 1-D contiguous ``arr`` as frames of ``chunk_bytes`` (the last one
    shorter; none for an empty array); returns the number of frames."""
    step = chunk_bytes // arr.itemsize
    frames = 0
    for lo in range(0, arr.size, step):
        conn.send_array(arr[lo : lo + step], kind)
        frames += 1
    return frames


def recv_chunked(conn: Connection, out: np.ndarray, kind: int, chunk_bytes: int) -> int:
    """Receive what :func:`send_chunked` sent with ``chunk_bytes`` straight into the
    1-D contiguous ``out``; returns the number of frames (see :func:`_chunk_elements`
    for the chunk sizes refused)."""
    step = _chunk_elements(conn, chunk_bytes, out.itemsize)
    frames = 0
    for lo in range(0, out.size, step):
        conn.recv_into(out[lo : lo + step], kind)
        frames += 1
    return frames


def recv_chunked_add(
    conn: Connection, out: np.ndarray, kind: int, chunk_bytes: int, scratch: np.ndarray
) -> np.ndarray:
    """As :func:`recv_chunked`, but add each chunk into ``out`` (``out += payload``, the
    same float operations as one whole-array add) through ``scratch``, so a delta costs
    one chunk of memory, not a copy of the shard. Returns the scratch buffer used (a
    larger one when ``scratch`` is smaller than a chunk), for the caller to keep."""
    step = _chunk_elements(conn, chunk_bytes, out.itemsize)
    need = min(step, out.size)
    if scratch.size < need or scratch.dtype != out.dtype:
        scratch = np.empty(need, dtype=out.dtype)
    for lo in range(0, out.size, step):
        piece = scratch[: min(step, out.size - lo)]
        conn.recv_into(piece, kind)
        out[lo : lo + piece.size] += piece
    return scratch


def _chunk_elements(conn: Connection, chunk_bytes: int, itemsize: int) -> int:
    """Elements per chunk of an announced chunk size; a size the sender could not have
    meant (not whole elements, above this side's frame cap) is a :class:`FrameError`
    (the stream cannot be followed any further)."""
    if chunk_bytes <= 0 or chunk_bytes % itemsize:
        raise FrameError(
            f"a parameter-server payload announced chunks of {chunk_bytes} bytes, which is "
            f"not a whole number of {itemsize}-byte elements"
        )
    if chunk_bytes > conn.max_frame_bytes:
        raise FrameError(
            f"a parameter-server payload announced chunks of {chunk_bytes} bytes, above this "
            f"side's frame cap of {conn.max_frame_bytes} bytes; give both ends the same cap"
        )
    return chunk_bytes // itemsize


def max_message_bytes(elements: int) -> int:
    """Longest compressed message accepted for ``elements`` values (never more than raw
    fp32 values plus int32 indices, plus the header and ctx numbers)."""
    return 8 * elements + (1 << 16)


class Codec(Protocol):
    """How a gradient (push) becomes a payload and back.

    One per worker and shard: a compressing codec keeps its
    :class:`~sparktrain.compress.base.BucketState` (error-feedback residual, PowerSGD's
    Q, the step count) inside. The shard's side only calls ``decode_into``, which is
    stateless.
    """

    name: str
    compressed: bool

    def encode(self, values: np.ndarray) -> np.ndarray:
        """The payload to send for ``values`` (may be ``values`` itself)."""

    def decode_into(self, payload: np.ndarray, out: np.ndarray) -> None:
        """Write the values of ``payload`` into ``out``."""


class IdentityCodec:
    """No compression: the payload is the array."""

    name = "none"
    compressed = False

    def encode(self, values: np.ndarray) -> np.ndarray:
        return values

    def decode_into(self, payload: np.ndarray, out: np.ndarray) -> None:
        if payload is not out:
            out[...] = payload


class CompressorCodec:
    """A compressor plus the sender's state for one shard: ``encode`` returns one uint8
    message (:func:`~sparktrain.compress.base.encode_message`)."""

    compressed = True

    def __init__(self, comp: Compressor, state: BucketState | None = None) -> None:
        self.comp = comp
        self.name = comp.spec
        self.state = state if state is not None else BucketState()

    def encode(self, values: np.ndarray) -> np.ndarray:
        payload, ctx = self.comp.compress(torch.from_numpy(values), self.state)
        self.state.step += 1
        return encode_message(payload, ctx, 0.0)

    def decode_into(self, payload: np.ndarray, out: np.ndarray) -> None:
        parts, ctx, _ = decode_message(payload, out.size)
        out[...] = self.comp.decompress(parts, ctx).numpy()

    def add_into(self, payload: np.ndarray, out: np.ndarray) -> None:
        """``out += D(payload)`` in place (the pull side of ``delta+``: the same op on
        the shard's mirror and on the worker's copy)."""
        parts, ctx, _ = decode_message(payload, out.size)
        self.comp.add_into(torch.from_numpy(out), parts, ctx)


@dataclass(frozen=True)
class Compression:
    """What ``config.compression`` means for the parameter server: the push compressor
    (gradients, with its ``+ef``) and the pull compressor (``delta+X``: X, no ef)."""

    spec: str
    push: Compressor | None
    pull: Compressor | None

    def push_codec(
        self, key: int = 0, shapes: Sequence[tuple[int, ...]] = (), seed: int = 0
    ) -> Codec:
        """A fresh push codec (own state) for one shard of one worker."""
        if self.push is None:
            return IdentityCodec()
        state = BucketState(key=key, shapes=tuple(tuple(s) for s in shapes), seed=seed)
        return CompressorCodec(self.push, state)

    def pull_codec(self, key: int = 0, seed: int = 0) -> CompressorCodec | None:
        """A fresh pull codec (own state: shards use one per rank) or None (exact)."""
        if self.pull is None:
            return None
        return CompressorCodec(self.pull, BucketState(key=key, seed=seed))


def make_compression(spec: str) -> Compression:
    """``config.compression`` split into push and pull compressors (ConfigError if the
    spec is invalid or cannot be used by the parameter server)."""
    parts = split_spec(spec)
    push = build(parts.gradient)
    pull = build(parts.base) if parts.delta else None
    if pull is not None and not ability(pull, "deterministic_decode"):
        raise ConfigError(
            f"compression={spec!r}: delta+powersgd cannot compress parameter-server pulls "
            "(its decode is a matrix product whose bits depend on the thread count, so the "
            "shard's mirror and the worker's copy would drift); use delta+int8, delta+fp16 "
            "or delta+topk:R, or plain powersgd:R+ef for the pushes only"
        )
    return Compression(spec, push, pull)


def make_codec(spec: str) -> Codec:
    """A push codec for ``config.compression`` (one shard, fresh state)."""
    return make_compression(spec).push_codec()


def send_rows(conn: Connection, ids: np.ndarray, rows: np.ndarray | None, chunk_bytes: int) -> int:
    """Send int64 row ids, then (unless None) their ``[n, dim]`` rows, each in chunks
    after the header the caller sent; returns the payload bytes (frame headers
    included)."""
    frames = send_chunked(conn, ids, KIND_DATA, chunk_bytes)
    nbytes = ids.nbytes
    if rows is not None:
        flat = rows.reshape(-1)
        frames += send_chunked(conn, flat, KIND_DATA, chunk_bytes)
        nbytes += flat.nbytes
    return frames * HEADER_BYTES + nbytes


def recv_row_ids(
    conn: Connection, n: int, limit: int, chunk_bytes: int, *, ascending: bool, what: str
) -> np.ndarray:
    """Receive ``n`` int64 row ids sent by :func:`send_rows` and check them: each in
    ``[0, limit)`` (the shard's rows of the table), strictly ascending if ``ascending``
    (a push's coalesced ids). A bad count or id is a :class:`FrameError`: the peer does
    not speak this protocol."""
    if not 0 <= n <= limit:
        raise FrameError(f"{what} names {n} rows of a table slice of {limit} rows")
    ids = np.empty(n, np.int64)
    if n:
        recv_chunked(conn, ids, KIND_DATA, chunk_bytes)
        if ids[0] < 0 or ids[-1] >= limit or ids.min() < 0 or ids.max() >= limit:
            raise FrameError(f"{what} names rows outside the table slice of {limit} rows")
        if ascending and n > 1 and not bool(np.all(ids[1:] > ids[:-1])):
            raise FrameError(f"{what} names rows that are not ascending and distinct")
    return ids
