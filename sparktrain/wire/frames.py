"""The frame format: what an authenticated connection carries after its handshake.

A frame is a header (with frame MACs, a 16-byte tag after it) followed by the raw bytes
of a C-contiguous array. Nothing is pickled: the dtype travels as a stable code and the
receiver checks kind, dtype, shape and length against its cap before reading the payload.
:class:`~sparktrain.wire.connection.Connection` sends and receives frames.

The header has two forms, told apart by their magic:

* the **long form** (``STF1``, 88 bytes): magic, kind, dtype code, ndim, flags, sequence
  number and payload length (64-bit), and eight 64-bit shape slots. Any array up to
  :data:`MAX_NDIM` dimensions, and abort notices (which name a rank in the shape);
* the **short form** (``STFs``, 16 bytes; 24 with a delivery stamp): magic, kind, dtype
  code, ndim (always 1), flags, then the sequence number and the payload length as 32-bit
  fields. Its shape is implied: ``length / itemsize`` elements. A sender uses it for
  every 1-D frame whose sequence number and length fit 32 bits (:func:`short_form`), so a
  small payload (a compressed segment of a few dozen bytes) no longer carries 72 bytes of
  empty shape slots.

Both forms start with the same eight bytes (magic, kind, code, ndim, flags), so a receiver
reads :data:`PREFIX_BYTES` first, learns the header's size from them
(:func:`header_size`) and reads the rest. A frame's MAC covers its whole header, the magic
included: the form is authenticated like every other field. Both ends of a connection run
the same sparktrain version (the handshake's protocol version says so), decode both forms,
and each frame says which it is, so they never need to agree on a choice.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from sparktrain.errors import FrameError

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
"""Magic of the long form."""
FRAME_HEADER = struct.Struct("<4sBBBBQQ" + "Q" * MAX_NDIM)
"""The long form: magic, kind, dtype code, ndim, flags, seq, payload length,
shape[MAX_NDIM]."""
HEADER_BYTES = FRAME_HEADER.size
"""Bytes of the long form: the largest header a frame can have (bounds and budgets)."""
SHORT_MAGIC = b"STFs"
"""Magic of the short form."""
SHORT_HEADER = struct.Struct("<4sBBBBII")
"""The short form: magic, kind, dtype code, ndim (1), flags, seq, payload length; a
delivery stamp (:data:`SHORT_STAMP`) follows when the flags say so."""
SHORT_STAMP = struct.Struct("<Q")
SHORT_HEADER_BYTES = SHORT_HEADER.size
"""Bytes of the short form without a stamp: the smallest header a frame can have."""
SHORT_MAX = 1 << 32
"""The short form's sequence numbers and lengths are below this."""
PREFIX_BYTES = SHORT_HEADER_BYTES
"""What a receiver reads of a header before it knows its form: never more than the
smallest frame (so a read never runs into the next frame), always enough to tell the
form and the header's size."""
FLAG_STAMPED = 1
"""Flag: the frame carries its delivery time on an emulated link (``time.time_ns()``;
see :mod:`sparktrain.wire.link`). In the long form it takes the last shape slot (8-D
shapes are sent with their last two dims merged); in the short form it follows the
header as a 64-bit field."""
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


class Header(NamedTuple):
    """A decoded frame header (either form)."""

    size: int
    """Bytes of the header (its MAC tag, if any, follows)."""
    kind: int
    code: int
    """The dtype code (not checked here for the long form: an abort notice has none)."""
    flags: int
    seq: int
    length: int
    """Payload bytes."""
    shape: tuple[int, ...]
    stamp: int
    """The delivery stamp (ns since the epoch) with :data:`FLAG_STAMPED`, else 0."""


def short_form(code: int, shape: Sequence[int], nbytes: int, seq: int) -> bool:
    """Whether a frame goes in the short form: 1-D, a known dtype whose itemsize times
    the element count is the length (an abort notice's is not), and a sequence number
    and length that fit 32 bits."""
    dtype = CODE_DTYPES.get(code)
    return (
        dtype is not None
        and len(shape) == 1
        and shape[0] * dtype.itemsize == nbytes
        and nbytes < SHORT_MAX
        and 0 <= seq < SHORT_MAX
    )


def header_bytes(code: int, shape: Sequence[int], nbytes: int, seq: int, stamped: bool) -> int:
    """The size of the header :func:`pack_header` writes for such a frame (no tag)."""
    if short_form(code, shape, nbytes, seq):
        return SHORT_HEADER_BYTES + (SHORT_STAMP.size if stamped else 0)
    return HEADER_BYTES


def pack_header(
    buf: bytearray | memoryview,
    kind: int,
    code: int,
    shape: Sequence[int],
    nbytes: int,
    seq: int,
    due_ns: int = 0,
) -> int:
    """Write a frame's header at the start of ``buf`` (at least :data:`HEADER_BYTES`
    long), in the short form where it applies (:func:`short_form`); returns its size.
    ``due_ns`` > 0: stamp the frame with that delivery time."""
    flags = FLAG_STAMPED if due_ns > 0 else 0
    if short_form(code, shape, nbytes, seq):
        SHORT_HEADER.pack_into(buf, 0, SHORT_MAGIC, kind, code, 1, flags, seq, nbytes)
        if due_ns > 0:
            SHORT_STAMP.pack_into(buf, SHORT_HEADER_BYTES, due_ns)
            return SHORT_HEADER_BYTES + SHORT_STAMP.size
        return SHORT_HEADER_BYTES
    dims = list(shape)
    if due_ns > 0 and len(dims) == MAX_NDIM:  # free the stamp's slot; the count is kept
        dims[-2:] = [dims[-2] * dims[-1]]
    ndim = len(dims)
    dims += [0] * (MAX_NDIM - ndim)
    if due_ns > 0:
        dims[-1] = due_ns
    FRAME_HEADER.pack_into(buf, 0, FRAME_MAGIC, kind, code, ndim, flags, seq, nbytes, *dims)
    return HEADER_BYTES


def header_size(prefix: bytes | bytearray | memoryview) -> int:
    """The size of the header whose first :data:`PREFIX_BYTES` bytes are ``prefix``;
    :class:`FrameError` if they start no sparktrain frame."""
    if len(prefix) < PREFIX_BYTES:
        raise FrameError(f"a header cut short at {len(prefix)} bytes")
    magic = bytes(prefix[:4])
    if magic == SHORT_MAGIC:
        return SHORT_HEADER_BYTES + (SHORT_STAMP.size if prefix[7] & FLAG_STAMPED else 0)
    if magic == FRAME_MAGIC:
        return HEADER_BYTES
    raise FrameError(f"bad magic {magic!r} (not a sparktrain frame)")


def unpack_header(buf: bytes | bytearray | memoryview) -> Header:
    """Decode the header at the start of ``buf`` (which holds at least
    :func:`header_size` bytes). Checks what the format alone says (magic, ndim, the
    short form's rules, the stamp's slot); the caller checks sequence numbers, kinds,
    its cap, dtypes and lengths. :class:`FrameError` on a malformed header."""
    size = header_size(buf)
    if len(buf) < size:
        raise FrameError(f"a {size}-byte header cut short at {len(buf)} bytes")
    if size < HEADER_BYTES:
        _, kind, code, ndim, flags, seq, length = SHORT_HEADER.unpack_from(buf)
        if ndim != 1:
            raise FrameError(f"a short-form header with ndim {ndim} (the form is 1-D only)")
        if kind == KIND_ABORT:
            raise FrameError("an abort notice in the short form (notices use the long one)")
        dtype = CODE_DTYPES.get(code)
        if dtype is None:
            raise FrameError(f"unknown dtype code {code}")
        if length % dtype.itemsize:
            raise FrameError(f"length {length} is not a whole number of {dtype} elements")
        stamp = SHORT_STAMP.unpack_from(buf, SHORT_HEADER_BYTES)[0] if flags & FLAG_STAMPED else 0
        return Header(size, kind, code, flags, seq, length, (length // dtype.itemsize,), stamp)
    fields = FRAME_HEADER.unpack_from(buf)
    _, kind, code, ndim, flags, seq, length = fields[:7]
    if ndim > MAX_NDIM:
        raise FrameError(f"ndim {ndim} > {MAX_NDIM}")
    stamp = 0
    if flags & FLAG_STAMPED:
        if ndim == MAX_NDIM:
            raise FrameError("a delivery stamp in a frame whose shape uses every slot")
        stamp = fields[STAMP_FIELD]
    return Header(size, kind, code, flags, seq, length, tuple(fields[7 : 7 + ndim]), stamp)
