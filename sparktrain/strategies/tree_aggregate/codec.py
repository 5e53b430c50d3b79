"""What a ``strategy="tree_aggregate"`` contribution is, and how it travels and sums.

A partition's contribution to a round is ``(payload, stats)``: ``payload`` the encoded
flat float32 vector the partition computed (:mod:`.task`), or ``None`` when it had
nothing to send, and ``stats`` a float64 vector with the slots below (all add up but
``COMPUTE_S``, which is a max). ``RDD.treeAggregate`` sums contributions with
:func:`merge`, its combOp, and the driver decodes the sum.

Compression (``config.compression``): the upload codec, :func:`make_codec`, is the spec's
gradient part. :class:`CompressedCodec` encodes a partition's vector into one
:func:`~sparktrain.compress.base.encode_message` buffer (what Spark ships as the task
result or shuffle block); combOp merges two payloads — part by part, still compressed,
when the compressor's single-round payloads are summable (fp16, bf16, randomk with the
round's shared seed), else by decoding into a dense float32 vector (a merged
int8/top-k/sign/PowerSGD payload is no longer a payload of that compressor). A ``delta+``
prefix also compresses the weights sent down: :func:`download_compressor` (the driver's
:mod:`.driver_weights`, the tasks' :mod:`.task_weights`).

Both sides use this module (the tasks encode and merge, the driver decodes): nothing here
imports pyspark.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np
import torch

from sparktrain.compress.base import (
    BucketState,
    Compressor,
    add_bf16,
    decode_message,
    encode_message,
)
from sparktrain.compress.feedback import ability
from sparktrain.compress.registry import build, split_spec
from sparktrain.errors import ConfigError

# Slots of a contribution's stats vector (DOWN_BYTES: weight bytes the task received).
SAMPLES, LOSS_SUM, EVAL_TOTAL, EVAL_ROWS, RAW_BYTES, WIRE_BYTES, COMPUTE_S, DOWN_BYTES = range(8)
NUM_STATS = 8

Contribution = tuple[Any, np.ndarray]  # (encoded payload or None, stats)


def zero_stats(size_slots: int = 0) -> np.ndarray:
    """An empty stats vector (plus ``2 * size_slots`` row-count slots in a sizing round)."""
    return np.zeros(NUM_STATS + 2 * size_slots, dtype=np.float64)


# ---------------------------------------------------------------------- payload codecs
class PayloadCodec(Protocol):
    """How a contribution's vector travels through treeAggregate (task results and
    shuffle blocks). The compression issue plugs a compressor in here: ``encode`` runs
    in the task after the partition's vector is computed, ``merge`` in every combOp."""

    name: str
    compressed: bool

    def encode(self, vec: np.ndarray, state: BucketState | None = None) -> Any: ...

    def decode(self, payload: Any) -> np.ndarray: ...

    def merge(self, a: Any, b: Any) -> Any: ...

    def nbytes(self, payload: Any) -> int: ...


class IdentityCodec:
    """``compression="none"``: the raw float32 vector; merge is an in-place sum."""

    name = "none"
    compressed = False

    def encode(self, vec: np.ndarray, state: BucketState | None = None) -> np.ndarray:
        return vec

    def decode(self, payload: Any) -> np.ndarray:
        return np.asarray(payload)

    def merge(self, a: Any, b: Any) -> Any:
        out = np.asarray(a)
        out += np.asarray(b)  # Spark lets combOp reuse its first argument
        return out

    def nbytes(self, payload: Any) -> int:
        return int(np.asarray(payload).nbytes)


class CompressedCodec:
    """A compressor on the treeAggregate path. A payload is either a compressed message
    (1-D uint8, straight from a partition or merged part by part) or, once two
    non-summable payloads were merged, a dense float32 vector."""

    compressed = True

    def __init__(self, comp: Compressor) -> None:
        self.comp = comp
        self.name = comp.spec
        # do two payloads with equal ctx sum part by part (fp16, bf16, randomk)?
        self.summable = bool(ability(comp, "parts_summable"))

    def encode(self, vec: np.ndarray, state: BucketState | None = None) -> np.ndarray:
        state = state if state is not None else BucketState()
        payload, ctx = self.comp.compress(torch.from_numpy(vec), state)
        return encode_message(payload, ctx, 0.0)

    @staticmethod
    def _is_message(payload: Any) -> bool:
        return isinstance(payload, np.ndarray) and payload.dtype == np.uint8

    def decode(self, payload: Any) -> np.ndarray:
        if not self._is_message(payload):
            return np.asarray(payload, dtype=np.float32)
        parts, ctx, _ = decode_message(payload)
        return self.comp.decompress(parts, ctx).numpy()

    def merge(self, a: Any, b: Any) -> Any:
        if self._is_message(a) and self._is_message(b) and self.summable:
            merged = self._merge_parts(a, b)
            if merged is not None:
                return merged
        dense = self.decode(a)  # decoded: a fresh array; dense: reused, as Spark allows
        if not dense.flags.writeable:
            dense = dense.copy()
        if self._is_message(b):
            parts, ctx, _ = decode_message(b, dense.size)
            self.comp.add_into(torch.from_numpy(dense), parts, ctx)
        else:
            dense += np.asarray(b, dtype=np.float32)
        return dense

    def _merge_parts(self, a: np.ndarray, b: np.ndarray) -> np.ndarray | None:
        """``a + b`` still compressed, or None when their ctx differ (then: dense)."""
        out = np.array(a, copy=True)  # a may be read-only or shared
        pa, ca, _ = decode_message(out)
        pb, cb, _ = decode_message(b)
        if ca != cb or [(p.dtype, p.size) for p in pa] != [(p.dtype, p.size) for p in pb]:
            return None
        for x, y in zip(pa, pb, strict=True):
            if x.dtype == np.int16:  # bfloat16 bits
                add_bf16(x, y, x)
            else:
                np.add(x, y, out=x)
        return out

    def nbytes(self, payload: Any) -> int:
        return int(np.asarray(payload).nbytes)


def make_codec(compression: str | Mapping[str, str]) -> PayloadCodec:
    """The upload codec for a ``compression`` spec: its gradient part (a ``delta+``
    prefix compresses the weight downloads, :func:`download_compressor`); a per-layer
    table is refused: a contribution is one flat vector."""
    if not isinstance(compression, str):
        raise ValueError(
            "tree_aggregate compresses each partition's flat vector with one spec; give one "
            "spec such as 'int8+ef' instead of a per-layer table"
        )
    parts = split_spec(compression)
    comp = build(parts.gradient)  # delta+: the weight downloads' part (download_compressor)
    return IdentityCodec() if comp is None else CompressedCodec(comp)


def download_compressor(compression: object) -> Compressor | None:
    """The compressor for weight downloads: ``X`` of a ``delta+X`` spec, else ``None``."""
    if not isinstance(compression, str):
        return None
    parts = split_spec(compression)
    if not parts.delta:
        return None
    comp = build(parts.base)
    if comp is not None and not ability(comp, "deterministic_decode"):
        raise ConfigError(
            f"compression={compression!r}: delta+powersgd cannot compress tree_aggregate's "
            "weight downloads (its decode depends on the thread count, so the copies would "
            "drift); use delta+int8, delta+fp16 or delta+topk:R, or plain powersgd:R+ef for "
            "the uploads only"
        )
    return comp


# ---------------------------------------------------------------------- combOp
def merge(
    a: Contribution | None, b: Contribution | None, codec: PayloadCodec
) -> Contribution | None:
    """treeAggregate's combOp: sum payloads and stats (compute time: max). ``None`` is the
    zero value, so no zero vector is ever shipped with the closure."""
    if a is None:
        return b
    if b is None:
        return a
    pa, sa = a
    pb, sb = b
    if pa is None:
        payload = pb
    elif pb is None:
        payload = pa
    else:
        payload = codec.merge(pa, pb)
    stats = sa + sb
    stats[COMPUTE_S] = max(sa[COMPUTE_S], sb[COMPUTE_S])
    return payload, stats


def make_comb_op(
    codec: PayloadCodec,
) -> Callable[[Contribution | None, Contribution | None], Contribution | None]:
    """treeAggregate's combOp."""

    def comb_op(a: Contribution | None, b: Contribution | None) -> Contribution | None:
        return merge(a, b, codec)

    return comb_op
