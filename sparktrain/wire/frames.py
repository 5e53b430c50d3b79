"""The frame format: what an authenticated connection carries after its handshake.

A frame is a fixed 88-byte header (magic, kind, dtype, ndim, flags, sequence number,
payload length, shape; with frame MACs, a 16-byte tag after it) followed by the raw bytes
of a C-contiguous array. Nothing is pickled: the dtype travels as a stable code and the
receiver checks kind, dtype, shape and length against its cap before reading the payload.
:class:`~sparktrain.wire.connection.Connection` sends and receives frames.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

MAX_FRAME_BYTES_DEFAULT = 1 << 30
"""Cap on one frame's payload; a header announcing more is rejected before any allocation."""

# Frame kinds. 1..15 are reserved for sparktrain's own use; callers (e.g. a parameter
# server) may use KIND_USER_MIN..255 for their own message types.
KIND_DATA = 1
"""Tensor payloads of a collective; counted in ``CommStats.raw_bytes_sent``."""
KIND_CONTROL = 2
"""Small control messages (JSON text, never pickle)."""
KIND_METRICS = 3
"""Progress/metrics records sent to the driver."""
KIND_PAYLOAD = 4
"""Frames of compressed collectives: not counted as raw bytes (the compressed exchange
adds the uncompressed equivalent itself)."""
KIND_ABORT = 15
"""Sent by a rank that is tearing its mesh down after a failure; names the lost rank."""
KIND_USER_MIN = 16

MAX_NDIM = 8

FRAME_MAGIC = b"STF1"
FRAME_HEADER = struct.Struct("<4sBBBBQQ" + "Q" * MAX_NDIM)
"""magic, kind, dtype code, ndim, flags, seq, payload length, shape[MAX_NDIM]."""
HEADER_BYTES = FRAME_HEADER.size
FLAG_STAMPED = 1
"""Flag: the last shape slot carries the frame's delivery time on an emulated link
(``time.time_ns()``; see :mod:`sparktrain.wire.link`). Receivers ignore unused shape
slots, so the stamp needs no new header field; 8-D shapes are sent with their last two
dims merged."""
STAMP_FIELD = 7 + MAX_NDIM - 1
"""Index of the delivery stamp in the unpacked header (the last shape slot)."""

# Numpy dtypes that may travel on the wire, by a stable code (never the dtype's repr).
DTYPE_CODES: dict[np.dtype[Any], int] = {
    np.dtype(np.uint8): 1,
    np.dtype(np.int8): 2,
    np.dtype(np.int16): 3,
    np.dtype(np.uint16): 4,
    np.dtype(np.int32): 5,
    np.dtype(np.uint32): 6,
    np.dtype(np.int64): 7,
    np.dtype(np.uint64): 8,
    np.dtype(np.float16): 9,
    np.dtype(np.float32): 10,
    np.dtype(np.float64): 11,
    np.dtype(np.bool_): 12,
    np.dtype(np.complex64): 13,
    np.dtype(np.complex128): 14,
}
CODE_DTYPES = {code: dt for dt, code in DTYPE_CODES.items()}
