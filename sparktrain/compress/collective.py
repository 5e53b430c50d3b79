"""Compressed gradient reduction on the ring and tree (one bucket at a time).

:class:`CompressedAllreduce` is what :class:`~sparktrain.worker.buckets.GradientBuckets`
calls instead of a plain SUM allreduce when ``config.compression`` is not ``none``. It
keeps one :class:`~sparktrain.compress.base.BucketState` per bucket and picks a path:

- *summable* compressors (fp16, bf16, randomk, powersgd) reduce inside the ring/tree in
  compressed form: ``2 (n - 1) / n`` payloads per rank on the ring;
- the others (int8, topk, sign) are *all-gathered* — each rank sends ``n - 1`` payloads
  (ring: around the ring; tree: recursive doubling) — and every rank decodes and adds
  all of them, its own included, in rank order. This is the only exact path for sparse
  payloads; for int8/sign a decompress-add-recompress ring would move ``2 (n - 1) / n``
  payloads (fewer for n >= 3, equal at n = 2) at the price of re-quantising partial sums
  with errors no error feedback sees; we take exactness, and say so in the summary.

Bitwise agreement: every rank ends with identical bits, because each rank applies the
same decoded bytes with the same ops in the same order (all-gather), or holds the bytes
the ring/tree made identical before decoding them (summable).

The weighting rule: the sample count never goes through a compressor. Buckets carry
``n_r g_r``; bucket 0's count is remembered for the step's other buckets and put in each
bucket's state (``ef.scale``) so that error feedback keeps its residual per sample (see
:mod:`sparktrain.compress.feedback`: otherwise a short last batch diverges). On the all-gather
path it rides in each message header (float64) and the counts are summed exactly; on
the summable path a one-element float64 SUM follows bucket 0.

Byte accounting: compressed frames use ``KIND_PAYLOAD``, so the wire counts them in
``wire_bytes_sent`` only, and each call adds to ``raw_bytes_sent`` what the plain
ring/tree would have sent for the uncompressed bucket (its count slot included).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from sparktrain.comm.ring import KIND_PAYLOAD, RingAllreduce, ring_raw_bytes_sent
from sparktrain.comm.tree import TreeAllreduce, tree_raw_bytes_sent
from sparktrain.compress.base import (
    BucketState,
    Compressor,
    decode_message,
    encode_message,
    message_nbytes,
)
from sparktrain.compress.feedback import SCALE
from sparktrain.errors import CommError, ConfigError


def path_for(comp: Compressor) -> str:
    """``"reduce"`` (inside the ring/tree) or ``"allgather"``."""
    return "reduce" if comp.summable else "allgather"


def bytes_per_rank(comp: Compressor, numel: int, world: int, algo: str = "ring") -> float:
    """Compressed payload bytes one rank sends per bucket on the chosen path (for docs,
    the bench and tests)."""
    payload = comp.payload_nbytes(numel)
    if world == 1:
        return 0.0
    if path_for(comp) == "allgather":
        return float((world - 1) * payload)
    if algo == "ring":
        return 2 * (world - 1) / world * payload
    rounds = (1 << (world.bit_length() - 1)).bit_length() - 1
    return float(rounds * payload)


class CompressedAllreduce:
    """Sum compressed buckets over the ranks of a ring or tree allreduce's mesh."""

    def __init__(self, comp: Compressor, algo: RingAllreduce | TreeAllreduce, seed: int = 0):
        if getattr(comp, "spec", "").startswith("delta"):
            raise ConfigError(
                "compression 'delta' encodes repeated sends of a value the receiver holds "
                "(strategy='ps' pulls); ring/tree exchange fresh gradients: drop 'delta+'"
            )
        self.comp = comp
        self.algo = algo
        self.mesh = algo.mesh
        self.seed = seed
        self.states: dict[int, BucketState] = {}
        self.path = path_for(comp)
        self._count = 1.0

    def _raw_bytes(self, length: int, itemsize: int) -> int:
        n, r = self.mesh.world_size, self.mesh.rank
        if isinstance(self.algo, RingAllreduce):
            return ring_raw_bytes_sent(length, n, r, itemsize)
        return tree_raw_bytes_sent(length, n, r, itemsize)

    def state(self, index: int, shapes: Sequence[tuple[int, ...]] = ()) -> BucketState:
        st = self.states.get(index)
        if st is None:
            st = BucketState(
                key=index,
                shapes=tuple(tuple(s) for s in shapes),
                seed=self.seed,
                stream=self.mesh.rank,
            )
            self.states[index] = st
        return st

    def reduce_(
        self,
        index: int,
        grads: torch.Tensor,
        count: float | None,
        *,
        shapes: Sequence[tuple[int, ...]] = (),
        raw_length: int | None = None,
    ) -> float:
        """Replace ``grads`` (1-D, this rank's ``n_r g_r``) by the sum over ranks.

        ``count`` is this rank's sample count (bucket 0; None for the others); returns
        the summed count (0.0 when ``count`` is None). ``raw_length`` is the elements the
        uncompressed bucket would have sent (with its count slot), for the byte figures.
        """
        state = self.state(index, shapes)
        if count is not None:  # bucket 0 opens a step: this rank's n_r for every bucket
            self._count = float(count)
        state.slots[SCALE] = self._count  # error feedback keeps its residual per sample
        length = grads.numel() if raw_length is None else raw_length
        self.mesh.stats.add_sent(0, self._raw_bytes(length, grads.element_size()))
        try:
            if self.path == "reduce":
                total_count = self._reduce(grads, state, count)
            else:
                total_count = self._allgather(grads, state, count)
        except CommError as exc:  # malformed payloads included: fail every rank now
            failure = self.mesh.abort(exc)
            if failure is exc:
                raise
            raise failure from exc
        state.step += 1
        return total_count

    def _sum(self, buf: np.ndarray, add: Any = None) -> None:
        self.algo.allreduce_(buf, add=add, kind=KIND_PAYLOAD)

    def _reduce(self, grads: torch.Tensor, state: BucketState, count: float | None) -> float:
        total, _ = self.comp.allreduce(grads, state, self._sum)  # type: ignore[attr-defined]
        grads.copy_(total)
        if count is None:
            return 0.0
        counts = np.array([count], dtype=np.float64)
        self._sum(counts)
        return float(counts[0])

    def _allgather(self, grads: torch.Tensor, state: BucketState, count: float | None) -> float:
        payload, ctx = self.comp.compress(grads, state)
        blob = encode_message(payload, ctx, 0.0 if count is None else count)
        numel = grads.numel()
        # a peer's message may be longer than ours (sampled top-k), never than raw floats
        limit = max(blob.nbytes, message_nbytes((), ctx) + 16 * numel + 4096)
        blobs = self.algo.allgather(blob, limit)
        acc = torch.zeros(numel, dtype=grads.dtype)
        total = 0.0
        for data in blobs:
            part, part_ctx, part_count = decode_message(data, numel)
            self.comp.add_into(acc, part, part_ctx)
            total += part_count
        grads.copy_(acc)
        return total
