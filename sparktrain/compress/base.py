"""The compressor protocol, per-bucket state, payload checks and the wire message.

The bottom of :mod:`sparktrain.compress`: it imports no compressor. The spec grammar
factories read is in :mod:`sparktrain.compress.spec`; names become compressors in
:mod:`sparktrain.compress.registry`.

Protocol
--------
A :class:`Compressor` holds hyper-parameters only (immutable once built). Everything
that changes from step to step lives in a :class:`BucketState` the caller keeps per
bucket (error-feedback residual, PowerSGD's Q, the delta reference, the step count),
as torch's ``PowerSGDState`` keeps state apart from hyper-parameters.

- ``compress(tensor, state) -> (payload, ctx)``: ``tensor`` is 1-D float (not modified);
  ``payload`` a tuple of 1-D numpy arrays (raw buffers, never pickled); ``ctx`` a
  :class:`Ctx` (element count plus a few floats), small and rebuilt from raw bytes.
- ``decompress(payload, ctx) -> tensor``: 1-D float32 of ``ctx.numel`` elements. A
  payload that does not match its ctx raises :class:`~sparktrain.errors.FrameError`.
- ``add_into(out, payload, ctx)``: ``out += decompress(payload, ctx)`` (sparse
  compressors do it without a dense temporary).
- ``summable``: payloads of all ranks, summed part by part (see ``allreduce``), decode
  to the sum of their tensors. Summable compressors also implement
  ``allreduce(tensor, state, sum_) -> (total, local)`` which reduces *inside* a SUM
  collective ``sum_(array, add)``; ``local`` is this rank's own contribution as the
  others see it (for error feedback). :func:`summable_allreduce` is the generic body.

:func:`encode_message` / :func:`decode_message` frame ``(payload, ctx, count)`` as one
``uint8`` buffer with a binary header, compact (14 bytes plus 5 a part) wherever its
sizes fit 32 bits, else long; the sample count travels here, uncompressed, so the
weighting rule (``task/buckets.py``) survives any compressor.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from sparktrain.errors import ConfigError, FrameError

Payload = tuple[np.ndarray, ...]
SumFn = Callable[..., None]
"""``sum_(buf, add=None)``: SUM ``buf`` over all ranks in place (``add`` for dtypes
numpy cannot add, e.g. bfloat16 held as int16)."""


@dataclass(frozen=True)
class Ctx:
    """What a receiver needs besides the payload buffers: the element count and a few
    compressor-specific numbers (a scale, a seed...). Travels as raw float64s."""

    numel: int
    meta: tuple[float, ...] = ()


@dataclass
class BucketState:
    """Mutable per-bucket state, kept by the caller, one per bucket (and per rank).

    ``shapes`` are the parameter shapes laid out in the bucket (PowerSGD compresses the
    matrices among them); ``seed`` and ``step`` must be equal on every rank (shared
    random choices). ``slots`` holds compressor state by name (``ef.residual``,
    ``powersgd.q``, ``delta.ref``...).
    """

    key: int = 0
    shapes: tuple[tuple[int, ...], ...] = ()
    seed: int = 0
    step: int = 0
    slots: dict[str, Any] = field(default_factory=dict)
    # Private randomness (stochastic rounding) must differ between ranks and must never
    # touch torch's global generator, which model initialisation and dropout rely on.
    stream: int = 0


@runtime_checkable
class Compressor(Protocol):
    """A gradient compressor; see the module docstring."""

    spec: str
    summable: bool

    def compress(self, tensor: torch.Tensor, state: BucketState) -> tuple[Payload, Ctx]: ...

    def decompress(self, payload: Payload, ctx: Ctx) -> torch.Tensor: ...

    def add_into(self, out: torch.Tensor, payload: Payload, ctx: Ctx) -> None: ...

    def payload_nbytes(self, numel: int) -> int:
        """Payload bytes for ``numel`` elements (expected value for variable sizes)."""
        ...


class BaseCompressor:
    """Shared defaults: dense ``add_into``, not summable."""

    spec = "?"
    summable = False
    # Abilities: what the collectives, the tree rounds and the parameter server ask of a
    # compressor (read through :func:`ability`, so a plug-in that does not subclass this
    # class gets these defaults).
    ring_path: str | None = None
    """The decode-add-encode ring its non-summable payloads may take: ``"recompress"``
    (decode a partial sum, add, re-encode: int8, sign), ``"resparsify"`` (keep each
    hop's top values; only under ``+ef``, which takes the loss: top-k) or None (the
    all-gather)."""
    coarse: bool = False
    """Recompressible, but ``compression_path="auto"`` keeps it on the all-gather: a
    re-encoding's error is of the order of the partial sum it encodes (sign)."""
    parts_summable: bool = False
    """Do two single-round payloads with equal ctx sum part by part, still compressed
    (fp16, bf16, randomk): tree_aggregate's combOp then merges them without decoding."""
    ddp_hook: str | None = None
    """The torch DDP communication hook that compresses as this does, for
    ``comm_backend="torch"`` (``"fp16"``, ``"bf16"``, ``"powersgd"``; its options from
    :meth:`ddp_hook_options`); None: torch has none, and that backend refuses the spec."""
    ddp_hook_feedback: bool = False
    """Does that hook also have plain ``+ef`` (PowerSGD's error feedback)?"""
    deterministic_decode: bool = True
    """Is decoding bit-identical on every process (thread counts included)? A ``delta+``
    mirror needs it: the sender's and the receiver's copies must not drift."""

    def ddp_hook_options(self) -> dict[str, Any]:
        """The keyword options of :attr:`ddp_hook` this instance was built with."""
        return {}

    def compress(self, tensor: torch.Tensor, state: BucketState) -> tuple[Payload, Ctx]:
        raise NotImplementedError

    def decompress(self, payload: Payload, ctx: Ctx) -> torch.Tensor:
        raise NotImplementedError

    def add_into(self, out: torch.Tensor, payload: Payload, ctx: Ctx) -> None:
        out.add_(self.decompress(payload, ctx))

    def payload_nbytes(self, numel: int) -> int:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.spec}>"


def summable_allreduce(
    comp: Compressor, tensor: torch.Tensor, state: BucketState, sum_: SumFn
) -> tuple[torch.Tensor, torch.Tensor]:
    """Single-round summable compressors: compress, SUM every part, decompress.

    Returns ``(total, local)``. Parts of dtype int16 are bfloat16 bits.
    """
    payload, ctx = comp.compress(tensor, state)
    local = comp.decompress(payload, ctx).clone()
    for part in payload:
        sum_(part, add=add_bf16 if part.dtype == np.int16 else None)
    return comp.decompress(payload, ctx), local


def add_bf16(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """``out = a + b`` for bfloat16 values held in int16 arrays (a ring/tree reducer)."""
    ta = torch.from_numpy(a).view(torch.bfloat16)
    tb = torch.from_numpy(b).view(torch.bfloat16)
    torch.add(ta, tb, out=torch.from_numpy(out).view(torch.bfloat16))


# ---------------------------------------------------------------------- checking
def bad(detail: str) -> FrameError:
    """The error for a payload that does not match its ctx (from a peer or a bug)."""
    return FrameError(f"malformed compressed payload: {detail}; the sender is out of step")


def expect_parts(payload: Payload, dtypes: tuple[Any, ...], what: str) -> None:
    if not isinstance(payload, tuple) or len(payload) != len(dtypes):
        raise bad(f"{what} expects {len(dtypes)} buffers, got {len(payload)}")
    for i, (part, dt) in enumerate(zip(payload, dtypes, strict=True)):
        if not isinstance(part, np.ndarray) or part.ndim != 1 or part.dtype != np.dtype(dt):
            got = getattr(part, "dtype", type(part).__name__)
            raise bad(f"{what} buffer {i} must be 1-D {np.dtype(dt)}, got {got}")


def expect_len(part: np.ndarray, n: int, what: str) -> None:
    if part.size != n:
        raise bad(f"{what} has {part.size} elements, expected {n}")


def expect_meta(ctx: Ctx, n: int, what: str) -> None:
    if not isinstance(ctx, Ctx) or len(ctx.meta) != n or ctx.numel < 0:
        raise bad(f"{what} ctx must carry {n} numbers and a count >= 0, got {ctx!r}")
    if not all(math.isfinite(v) for v in ctx.meta):
        raise bad(f"{what} ctx has non-finite numbers {ctx.meta}")


def as_tensor(part: np.ndarray) -> torch.Tensor:
    """A torch view of a payload buffer (copied first if read-only or misaligned)."""
    if not part.flags.writeable or not part.flags.aligned:
        part = part.copy()
    return torch.from_numpy(part)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A 1-D numpy view of a CPU tensor (bfloat16 as int16 bits)."""
    t = t.detach().reshape(-1).contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy()


# ---------------------------------------------------------------------- wire message
# Two forms, told apart by their magic. The long form: a 24-byte header, a 16-byte
# table entry per part, the ctx floats, then each part 8-byte aligned. The compact
# form, for every message whose sizes fit 32 bits (all but the huge), saves what a small
# payload cannot afford (a 1 % top-k segment of a small model is ~80 bytes): a 14-byte
# header (element count and sample count as uint32), a 5-byte table entry per part,
# the ctx floats, then each part aligned to its own itemsize (no tail padding).
_MAGIC = b"STC1"
_HEAD = struct.Struct("<4sBxHqd")  # magic, parts, meta (up to MAX_META), numel, count
_PART = struct.Struct("<B7xQ")  # dtype code, nbytes
_SHORT_MAGIC = b"STCs"
_SHORT_HEAD = struct.Struct("<4sBBII")  # magic, parts, meta, numel, count
_SHORT_PART = struct.Struct("<BI")  # dtype code, nbytes
_SHORT_MAX = 1 << 32
"""The compact form's element count, sample count and part sizes are below this."""
_SHORT_MAX_META = 255
_CODES: dict[np.dtype[Any], int] = {
    np.dtype(np.uint8): 1,
    np.dtype(np.int8): 2,
    np.dtype(np.int16): 3,
    np.dtype(np.int32): 4,
    np.dtype(np.int64): 5,
    np.dtype(np.float16): 6,
    np.dtype(np.float32): 7,
    np.dtype(np.float64): 8,
    np.dtype(np.uint16): 9,
}
_DTYPES: dict[int, np.dtype[Any]] = {code: dt for dt, code in _CODES.items()}
MAX_PARTS = 16
MAX_META = 1024


def _pad8(n: int) -> int:
    return (n + 7) & ~7


def _align(pos: int, itemsize: int) -> int:
    return -(-pos // itemsize) * itemsize


def _is_whole(count: float, below: float) -> bool:
    return math.isfinite(count) and 0 <= count < below and count == int(count)


def compact_form(payload: Payload, ctx: Ctx, count: float = 0.0) -> bool:
    """Whether :func:`encode_message` writes ``(payload, ctx, count)`` in the compact
    form: an element count, a sample count (a whole number) and part sizes below 2**32,
    at most 255 ctx numbers. Else the long form."""
    return (
        0 <= ctx.numel < _SHORT_MAX
        and len(ctx.meta) <= _SHORT_MAX_META
        and _is_whole(count, _SHORT_MAX)
        and all(p.nbytes < _SHORT_MAX for p in payload)
    )


def _compact_layout(table: list[tuple[np.dtype[Any], int]], nmeta: int) -> tuple[list[int], int]:
    """The compact form's part offsets and total length."""
    pos = _SHORT_HEAD.size + _SHORT_PART.size * len(table) + 8 * nmeta
    starts = []
    for dt, nbytes in table:
        pos = _align(pos, dt.itemsize)
        starts.append(pos)
        pos += nbytes
    return starts, pos


def message_nbytes(payload: Payload, ctx: Ctx, count: float = 0.0) -> int:
    """Length of :func:`encode_message`'s output (of ``count`` 0 by default: the
    compact form wherever the sizes allow)."""
    if compact_form(payload, ctx, count):
        return _compact_layout([(p.dtype, p.nbytes) for p in payload], len(ctx.meta))[1]
    return (
        _HEAD.size
        + _PART.size * len(payload)
        + 8 * len(ctx.meta)
        + sum(_pad8(p.nbytes) for p in payload)
    )


def encode_message(payload: Payload, ctx: Ctx, count: float = 0.0) -> np.ndarray:
    """``(payload, ctx, count)`` as one ``uint8`` buffer: header, part table, ctx floats,
    then each part's raw bytes, aligned. The compact form wherever its sizes allow
    (:func:`compact_form`), else the long form. No pickle."""
    if len(payload) > MAX_PARTS or len(ctx.meta) > MAX_META:
        raise ConfigError(f"a payload has at most {MAX_PARTS} parts and {MAX_META} ctx numbers")
    if compact_form(payload, ctx, count):
        return _encode_compact(payload, ctx, int(count))
    out = np.zeros(message_nbytes(payload, ctx, count), dtype=np.uint8)
    buf = out.data
    _HEAD.pack_into(buf, 0, _MAGIC, len(payload), len(ctx.meta), ctx.numel, float(count))
    pos = _HEAD.size
    for part in payload:
        _PART.pack_into(buf, pos, _CODES[part.dtype], part.nbytes)
        pos += _PART.size
    if ctx.meta:
        out[pos : pos + 8 * len(ctx.meta)] = np.asarray(ctx.meta, dtype="<f8").view(np.uint8)
        pos += 8 * len(ctx.meta)
    for part in payload:
        raw = np.ascontiguousarray(part).reshape(-1).view(np.uint8)
        out[pos : pos + raw.size] = raw
        pos += _pad8(raw.size)
    return out


def _encode_compact(payload: Payload, ctx: Ctx, count: int) -> np.ndarray:
    starts, total = _compact_layout([(p.dtype, p.nbytes) for p in payload], len(ctx.meta))
    out = np.zeros(total, dtype=np.uint8)
    buf = out.data
    _SHORT_HEAD.pack_into(buf, 0, _SHORT_MAGIC, len(payload), len(ctx.meta), ctx.numel, count)
    pos = _SHORT_HEAD.size
    for part in payload:
        _SHORT_PART.pack_into(buf, pos, _CODES[part.dtype], part.nbytes)
        pos += _SHORT_PART.size
    if ctx.meta:
        struct.pack_into(f"<{len(ctx.meta)}d", buf, pos, *ctx.meta)
    for part, start in zip(payload, starts, strict=True):
        raw = np.ascontiguousarray(part).reshape(-1).view(np.uint8)
        out[start : start + raw.size] = raw
    return out


def decode_message(
    blob: np.ndarray | bytes, numel: int | None = None
) -> tuple[Payload, Ctx, float]:
    """Inverse of :func:`encode_message` (either form); checks every length against the
    buffer (and ``ctx.numel`` against ``numel`` if given). Raises FrameError, never
    crashes.

    Bytes from a socket must be decoded with the ``numel`` the receiver expects: a sparse
    message's element count is not bounded by its size, so without it a forged count
    makes the decompressor allocate that many elements."""
    data = np.frombuffer(blob, dtype=np.uint8) if isinstance(blob, bytes | bytearray) else blob
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 1:
        raise bad("a message must be a 1-D uint8 buffer")
    magic = data[:4].tobytes()
    compact = magic == _SHORT_MAGIC
    head, entry = (_SHORT_HEAD, _SHORT_PART) if compact else (_HEAD, _PART)
    if data.size < head.size:
        raise bad(f"{data.size} bytes is shorter than the {head.size}-byte header")
    view = np.ascontiguousarray(data).data
    if compact:
        _, nparts, nmeta, got_numel, count = _SHORT_HEAD.unpack_from(view, 0)
    elif magic == _MAGIC:
        _, nparts, nmeta, got_numel, count = _HEAD.unpack_from(view, 0)
    else:
        raise bad(f"bad magic {magic!r}")
    if nparts > MAX_PARTS or nmeta > MAX_META:
        raise bad(f"{nparts} parts / {nmeta} ctx numbers exceed the limits")
    if got_numel < 0 or (numel is not None and got_numel != numel):
        raise bad(f"it describes {got_numel} elements, expected {numel}")
    if not (math.isfinite(count) and count >= 0 and count == int(count)):
        raise bad(f"sample count {count!r} is not a whole number >= 0")
    pos = head.size
    table = []
    if data.size < pos + entry.size * nparts + 8 * nmeta:
        raise bad("truncated part table")
    for _ in range(nparts):
        code, nbytes = entry.unpack_from(view, pos)
        pos += entry.size
        dt = _DTYPES.get(code)
        if dt is None or nbytes % dt.itemsize:
            raise bad(f"part of dtype code {code} with {nbytes} bytes")
        table.append((dt, nbytes))
    meta = tuple(float(v) for v in struct.unpack_from(f"<{nmeta}d", view, pos))
    pos += 8 * nmeta
    if compact:
        starts, end = _compact_layout(table, nmeta)
    else:
        starts = []
        for _, nbytes in table:
            starts.append(pos)
            pos += _pad8(nbytes)
        end = pos
    if end != data.size:
        raise bad(f"{data.size} bytes do not match the part table")
    parts = tuple(
        data[start : start + nbytes].view(dt)
        for (dt, nbytes), start in zip(table, starts, strict=True)
    )
    return parts, Ctx(int(got_numel), meta), float(count)
