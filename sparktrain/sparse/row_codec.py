"""Compressed row messages: delta-coded row ids and values through the job's compressor.

The row way of ``exchange.py`` puts every rank's touched rows of a step into one
allgathered message. Uncompressed, a row costs an int64 id plus ``dim`` floats. Here:

- **ids** (:func:`encode_ids`): the row ids are sorted and unique, so the first id and
  the differences to the next go out, each difference in the narrowest unsigned type
  that holds the largest one (uint8/16/32/64, chosen per message, its width in the
  header). Zipf ids of a 1M-row table touched by a few thousand samples mostly differ by
  less than 256: one byte an id instead of eight. :func:`decode_ids` checks everything
  (width, count, strictly increasing, inside the table) and raises ``bad(...)``
  (a :class:`~sparktrain.errors.FrameError`) on anything else.
- **values** (:class:`RowCompression`): the ``rows x dim`` block as one flat vector
  through the compressor that the per-layer policy gives the table's parameter name,
  with its own :class:`~sparktrain.compress.base.BucketState` per table. ``+ef`` keeps
  the residual *sparse*: ``(ids, per-sample rows)`` of the rows whose error is carried,
  never a table-sized tensor (see :class:`RowCompression` for when it is merged).

Every rank decodes every message and ``index_add_``\\ s it, so any compressor works,
summable or not; all ranks sum the same decoded rows in the same order, so their bits
agree.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import torch

from sparktrain.compress.base import BucketState, Compressor, bad, decode_message, encode_message
from sparktrain.compress.feedback import ErrorFeedback
from sparktrain.compress.registry import build, split_spec
from sparktrain.compress.snapshot import dump_state, load_state
from sparktrain.errors import ConfigError

# ---------------------------------------------------------------------- row ids
_IDS_HEAD = struct.Struct("<BxxxIq")  # delta width in bytes (0: no deltas), count, first id
_WIDTHS: dict[int, np.dtype[Any]] = {
    1: np.dtype("<u1"),
    2: np.dtype("<u2"),
    4: np.dtype("<u4"),
    8: np.dtype("<u8"),
}
MAX_IDS = 2**32 - 1


def _width(largest: int) -> int:
    for width in (1, 2, 4):
        if largest < 1 << (8 * width):
            return width
    return 8


def encode_ids(ids: torch.Tensor | np.ndarray) -> np.ndarray:
    """Strictly increasing non-negative int64 row ids as bytes (1-D uint8): a 16-byte
    header (delta width, count, first id), then the ``count - 1`` differences in the
    narrowest unsigned type that holds the largest. Vectorised (``np.diff``)."""
    arr = ids.detach().cpu().numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids)
    arr = arr.astype(np.int64, copy=False).reshape(-1)
    k = int(arr.size)
    if k > MAX_IDS:
        raise ValueError(f"{k} row ids in one message; at most {MAX_IDS}")
    if k == 0:
        return np.frombuffer(_IDS_HEAD.pack(0, 0, 0), dtype=np.uint8).copy()
    if int(arr[0]) < 0:
        raise ValueError(f"row id {int(arr[0])} is negative")
    diffs = np.diff(arr)
    if diffs.size and int(diffs.min()) < 1:
        raise ValueError("row ids must be sorted and unique (strictly increasing)")
    width = _width(int(diffs.max())) if diffs.size else 0
    head = np.frombuffer(_IDS_HEAD.pack(width, k, int(arr[0])), dtype=np.uint8)
    if not diffs.size:
        return head.copy()
    return np.concatenate([head, diffs.astype(_WIDTHS[width]).view(np.uint8)])


def ids_nbytes(blob: np.ndarray) -> int:
    """The length of the ids message at the start of ``blob`` (from its header)."""
    if blob.size < _IDS_HEAD.size:
        raise bad(f"{blob.size} bytes hold no row-id header")
    width, k, _ = _IDS_HEAD.unpack_from(np.ascontiguousarray(blob[: _IDS_HEAD.size]).data)
    if width not in (0, *_WIDTHS) or (width == 0) != (k <= 1):
        raise bad(f"row ids of width {width} for {k} ids")
    return _IDS_HEAD.size + width * max(0, k - 1)


def decode_ids(blob: np.ndarray, num_rows: int) -> torch.Tensor:
    """Inverse of :func:`encode_ids` for a table of ``num_rows`` rows: int64 ids,
    strictly increasing, in ``[0, num_rows)``; anything else raises ``bad(...)``."""
    if not isinstance(blob, np.ndarray) or blob.dtype != np.uint8 or blob.ndim != 1:
        raise bad("row ids must be a 1-D uint8 buffer")
    n = ids_nbytes(blob)
    if blob.size != n:
        raise bad(f"row ids take {blob.size} bytes, their header says {n}")
    width, k, first = _IDS_HEAD.unpack_from(np.ascontiguousarray(blob[: _IDS_HEAD.size]).data)
    if k == 0:
        if first != 0:
            raise bad("an empty row-id list carries a first id")
        return torch.zeros(0, dtype=torch.int64)
    if k > num_rows or not 0 <= first < num_rows:
        raise bad(f"{k} row ids from {first} do not fit a table of {num_rows} rows")
    if k == 1:
        return torch.tensor([first], dtype=torch.int64)
    diffs = np.frombuffer(blob[_IDS_HEAD.size :].tobytes(), dtype=_WIDTHS[width]).astype(np.uint64)
    if int(diffs.min()) < 1 or int(diffs.max()) >= num_rows:
        raise bad("row-id differences must be in [1, rows of the table)")
    # each step adds less than 2**63 to a value below 2**63: a wrap of the uint64 sum
    # would make it fall, so "strictly increasing" also rules overflow out
    out = np.empty(k, dtype=np.uint64)
    out[0] = first
    np.cumsum(diffs, out=out[1:])
    out[1:] += np.uint64(first)
    if int(out[-1]) >= num_rows or (k > 2 and not bool((out[2:] > out[1:-1]).all())):
        raise bad(f"row ids run past the table's {num_rows} rows")
    return torch.from_numpy(out.view(np.int64))


def plain_ids_nbytes(k: int) -> int:
    """Bytes of ``k`` ids as the uncompressed message sends them (a count, int64 ids)."""
    return 8 + 8 * k


# ---------------------------------------------------------------------- row values
RESIDUAL_IDS = "rows.residual_ids"
RESIDUAL_SLOT = "rows.residual_slot"
RESIDUAL_ROWS = "rows.residual"
"""Slots of a table's BucketState under ``+ef``: the ids whose error is carried
(int64, ascending), where each one's row is in the row buffer (int64), and the buffer
(float32 ``[capacity, dim]``, per-sample rows; its first ``len(ids)`` rows are used).
The buffer grows by doubling and rows stay where they were put, so a step writes only
the rows it touched: re-sorting a growing residual's rows every step cost more than
compressing the message."""

ROWS_KEY_BASE = 1 << 20
"""Tables' BucketState keys start here: apart from the dense buckets' indices, so a
compressor's private generator (seeded from the key) differs from any bucket's."""


def row_specs(compression: str | Any, names: list[str]) -> list[str]:
    """The spec each table's rows take: the per-layer policy's, except that a single
    job-wide spec string drops what no table keeps (DGC's ``momentum``, ``mask`` and
    ``local_clip`` of ``+ef``), so the rows get plain error feedback with the same
    ``reset``. That is what the tables trained with before their rows were compressed
    (momentum correction sets the optimizer's momentum to 0, and the compressor did not
    reach the rows), so such a job keeps working. A compression *table* naming a table
    with those options is refused by :class:`RowCompression`: the user asked for it."""
    from sparktrain.compress.policy import resolve_policy

    specs = resolve_policy(compression, names)
    if not isinstance(compression, str) or compression.strip().lower() == "none":
        return specs
    parts = split_spec(compression)
    comp = build(parts.gradient)
    if not isinstance(comp, ErrorFeedback) or not (comp.momentum or comp.local_clip):
        return specs
    plain = f"{comp.inner.spec}+ef" + (f":reset={comp.reset}" if comp.reset else "")
    return [("delta+" if parts.delta else "") + plain] * len(names)


class RowCompression:
    """One table's value compressor and state, for :class:`SparseRowExchange`.

    ``spec`` is the spec the per-layer policy gives the table (``"none"``: values go
    raw). ``+ef`` is handled here, not by :class:`ErrorFeedback` (whose residual is a
    dense vector of the input's length, and a row block's length changes every step):
    the residual is kept per table as ``(ids, rows)`` in per-sample units (the
    ``ef.scale`` rule of :mod:`sparktrain.compress.feedback`). A step's block is
    ``weight * (g + e)`` on the rows this rank touched, ``e`` the carried error of those
    rows; what compression leaves out of them replaces their residual. Rows this rank
    did not touch keep theirs until it touches them again (or the table goes the dense
    way, which carries every residual row exactly and clears them): nothing is lost,
    the message stays the size of the touched rows. ``+ef:reset=N`` clears the residual
    every N steps. ``+ef:momentum`` (DGC) is refused: a per-row momentum is not kept.
    """

    def __init__(self, spec: str, key: int, seed: int, stream: int) -> None:
        self.spec = spec
        gradient = split_spec(spec).gradient if spec != "none" else "none"
        comp = build(gradient)
        self.reset = 0
        self.feedback = isinstance(comp, ErrorFeedback)
        if isinstance(comp, ErrorFeedback):
            if comp.momentum or comp.local_clip:
                raise ConfigError(
                    f"compression {spec!r} on a sparse=True table: the row path keeps a "
                    "sparse residual but no per-row momentum or clipping; give the table "
                    "a spec with plain '+ef' (or '+ef:reset=N') in the compression table"
                )
            self.reset = comp.reset
            comp = comp.inner
        self.comp: Compressor | None = comp
        self.state = BucketState(key=ROWS_KEY_BASE + key, seed=seed, stream=stream)

    @property
    def compressed(self) -> bool:
        return self.comp is not None

    # ------------------------------------------------------------------ residual
    def residual(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The carried ``(ids, per-sample rows)`` (the rows gathered), or None."""
        found = self._residual()
        if found is None:
            return None
        ids, slot, buf = found
        return ids, buf[slot]

    def _residual(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        ids = self.state.slots.get(RESIDUAL_IDS)
        if ids is None or ids.numel() == 0:
            return None
        return ids, self.state.slots[RESIDUAL_SLOT], self.state.slots[RESIDUAL_ROWS]

    def _clear(self) -> None:
        for name in (RESIDUAL_IDS, RESIDUAL_SLOT, RESIDUAL_ROWS):
            self.state.slots.pop(name, None)

    def _begin(self) -> None:
        if self.reset and self.state.step > 0 and self.state.step % self.reset == 0:
            self._clear()

    def take_all(
        self, ids: torch.Tensor, rows: torch.Tensor, weight: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The dense way (exact): ``rows`` plus every carried residual row times
        ``weight``, on the union of their ids; the residual is cleared (sent). Without
        samples (``weight <= 0``) the residual stays for a later step."""
        self._begin()
        res = self.residual() if self.feedback else None
        if res is None or weight <= 0:
            return ids, rows
        r_ids, r_rows = res
        union, where = torch.unique(torch.cat([ids, r_ids]), sorted=True, return_inverse=True)
        out = torch.zeros((union.numel(), rows.shape[1]), dtype=rows.dtype)
        out.index_add_(0, where[: ids.numel()], rows)
        out.index_add_(0, where[ids.numel() :], r_rows.to(rows.dtype) * weight)
        self._clear()
        return union, out

    # ------------------------------------------------------------------ the message
    def encode(self, ids: torch.Tensor, rows: torch.Tensor, weight: float) -> np.ndarray:
        """This rank's message for the table: ids (delta-coded), then the values
        ``rows`` (already times ``weight``) raw or compressed. Updates the residual."""
        self._begin()
        ids_blob = encode_ids(ids)
        if self.comp is None:
            values = rows.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
            return _frame(ids_blob, values)
        x = rows.detach().to(torch.float32).reshape(-1)
        found = self._residual() if self.feedback else None
        hit = pos = None
        if found is not None and ids.numel() and weight > 0:
            r_ids, slot, buf = (t.numpy() for t in found)
            # which carried rows this rank touched again (both lists ascending). numpy,
            # not torch, for this bookkeeping: torch runs these small index ops on its
            # thread pool, which on a loaded machine spins (measured 200 ms a step with
            # 2 threads at load 13-25 against 12 ms on one)
            want = ids.numpy()
            pos = np.minimum(np.searchsorted(r_ids, want), r_ids.size - 1)
            hit = r_ids[pos] == want
            pos = slot[pos[hit]]  # their rows in the buffer
            x = x.clone()
            block = x.numpy().reshape(ids.numel(), -1)
            block[hit] += buf[pos] * np.float32(weight)
        payload, ctx = self.comp.compress(x, self.state)
        if self.feedback and weight > 0 and ids.numel():
            left = (x - self.comp.decompress(payload, ctx)).div_(weight)
            self._keep(ids.numpy(), left.numpy().reshape(ids.numel(), -1), hit, pos)
        return _frame(ids_blob, encode_message(payload, ctx, 0.0))

    def _keep(
        self,
        ids: np.ndarray,
        left: np.ndarray,
        hit: np.ndarray | None,
        pos: np.ndarray | None,
    ) -> None:
        """The residual after a step: ``left`` (what compression left out of the
        touched rows ``ids``) replaces the rows of ids already carried (``hit``, at
        buffer rows ``pos``) and is appended for new ids; untouched rows stay."""
        found = self._residual()
        if found is None or hit is None or pos is None:
            r_ids = np.zeros(0, dtype=np.int64)
            slot = np.zeros(0, dtype=np.int64)
            buf = torch.zeros((0, left.shape[1]), dtype=torch.float32)
            hit = np.zeros(ids.size, dtype=bool)
        else:
            r_ids, slot, buf = found[0].numpy(), found[1].numpy(), found[2]
            buf.numpy()[pos] = left[hit]
        new = ~hit
        m, used = int(new.sum()), int(r_ids.size)
        if not m:
            return
        if used + m > buf.shape[0]:  # grow by doubling: amortised, rows keep their place
            grown = torch.zeros((max(2 * buf.shape[0], used + m), left.shape[1]))
            grown[:used] = buf[:used]
            buf = grown
        buf.numpy()[used : used + m] = left[new]
        all_ids = np.concatenate([r_ids, ids[new]])
        order = np.argsort(all_ids, kind="stable")
        all_slot = np.concatenate([slot, np.arange(used, used + m, dtype=np.int64)])
        self.state.slots[RESIDUAL_IDS] = torch.from_numpy(all_ids[order])
        self.state.slots[RESIDUAL_SLOT] = torch.from_numpy(all_slot[order])
        self.state.slots[RESIDUAL_ROWS] = buf

    def step_done(self) -> None:
        """Every rank calls it once per exchange (whichever way the table went), so the
        step counters agree."""
        self.state.step += 1

    def decode(
        self, blob: np.ndarray, num_rows: int, dim: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inverse of :meth:`encode` (of any rank): ``(ids, rows)`` in ``dtype``."""
        ids_blob, values = _unframe(blob)
        ids = decode_ids(ids_blob, num_rows)
        k = int(ids.numel())
        if self.comp is None:
            itemsize = torch.empty((), dtype=dtype).element_size()
            if values.size != k * dim * itemsize:
                raise bad(f"{values.size} bytes of raw rows for {k} rows of {dim}")
            if k * dim == 0:
                return ids, torch.zeros((k, dim), dtype=dtype)
            rows = torch.frombuffer(values.copy().data, dtype=dtype, count=k * dim)
            return ids, rows.view(k, dim)
        payload, ctx, _ = decode_message(values, numel=k * dim)
        return ids, self.comp.decompress(payload, ctx).view(k, dim).to(dtype)

    def state_dict(self) -> dict[str, Any]:
        """This table's compressor state (residual, generators, step) for a checkpoint."""
        return {"spec": self.spec, "state": dump_state(self.state)}

    def load_state_dict(self, data: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s output (same spec, same rank)."""
        if data.get("spec") != self.spec:
            raise ConfigError(
                f"the checkpoint compressed this table's rows with {data.get('spec')!r}, "
                f"this run with {self.spec!r}: resume with the same compression"
            )
        self.state = load_state(data["state"])


_FRAME = struct.Struct("<QQ")  # bytes of the ids, bytes of the values


def _pad8(n: int) -> int:
    return (n + 7) & ~7


def _frame(ids_blob: np.ndarray, values: np.ndarray) -> np.ndarray:
    """One table's part of a message: lengths, ids, values (each 8-byte aligned)."""
    a, b = ids_blob.size, values.size
    out = np.zeros(_FRAME.size + _pad8(a) + _pad8(b), dtype=np.uint8)
    _FRAME.pack_into(out.data, 0, a, b)
    out[_FRAME.size : _FRAME.size + a] = ids_blob
    start = _FRAME.size + _pad8(a)
    out[start : start + b] = values.reshape(-1).view(np.uint8)
    return out


def _unframe(blob: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if blob.size < _FRAME.size:
        raise bad(f"a table's part of {blob.size} bytes has no header")
    a, b = _FRAME.unpack_from(np.ascontiguousarray(blob[: _FRAME.size]).data)
    if _FRAME.size + _pad8(a) + _pad8(b) != blob.size:
        raise bad(f"a table's part of {blob.size} bytes does not hold {a} + {b} bytes")
    start = _FRAME.size + _pad8(a)
    return blob[_FRAME.size : _FRAME.size + a], blob[start : start + b]


def pack_tables(count: float, parts: list[np.ndarray]) -> np.ndarray:
    """A rank's message: its sample count (float64), per table a uint64 length and the
    table's part (from :meth:`RowCompression.encode`)."""
    out = [np.array([count], dtype="<f8").view(np.uint8)]
    for part in parts:
        out.append(np.array([part.size], dtype="<u8").view(np.uint8))
        out.append(part)
    return np.concatenate(out)


def unpack_tables(blob: np.ndarray, tables: int) -> tuple[float, list[np.ndarray]]:
    """Inverse of :func:`pack_tables` for ``tables`` tables; ``bad(...)`` on a mismatch."""
    if not isinstance(blob, np.ndarray) or blob.dtype != np.uint8 or blob.ndim != 1:
        raise bad("a row message must be a 1-D uint8 buffer")
    if blob.size < 8:
        raise bad(f"a row message of {blob.size} bytes has no count")
    if not blob.flags.writeable:  # received bytes: torch views need writable memory
        blob = blob.copy()
    count = float(blob[:8].view("<f8")[0])
    if not np.isfinite(count) or count < 0:
        raise bad(f"a row message's sample count {count!r}")
    pos, parts = 8, []
    for _ in range(tables):
        if blob.size < pos + 8:
            raise bad("a row message ends inside a table's length")
        n = int(blob[pos : pos + 8].view("<u8")[0])
        if n > blob.size - pos - 8:
            raise bad(f"a table's part of {n} bytes runs past the message")
        parts.append(blob[pos + 8 : pos + 8 + n])
        pos += 8 + n
    if pos != blob.size:
        raise bad(f"a row message has {blob.size - pos} bytes too many")
    return count, parts
