"""Compressed gradient reduction on the ring and tree (one bucket at a time).

:class:`CompressedAllreduce` is what :class:`~sparktrain.task.buckets.GradientBuckets`
calls instead of a plain SUM allreduce when ``config.compression`` is not ``none``. It
keeps one :class:`~sparktrain.compress.base.BucketState` per bucket and picks a path:

- *summable* compressors (fp16, bf16, randomk, powersgd) reduce inside the ring/tree in
  compressed form: ``2 (n - 1) / n`` payloads per rank on the ring;
- the others are *all-gathered* — each rank sends ``n - 1`` payloads (ring: around the
  ring; tree: recursive doubling) — and every rank decodes and adds all of them, its own
  included, in rank order. Exact, and the only path for top-k without ``+ef`` (the
  union of index sets would grow hop by hop);
- dense non-summable ones (int8; sign only when forced, see :data:`COARSE`) on the
  ring from world 3 take the
  *decompress-add-recompress* ring (``"recompress"``): a reduce-scatter whose hops decode
  the partial sum, add their own segment and re-encode it, then an all-gather of the
  finished segments, ``2 (n - 1) / n`` payloads per rank. Each re-encoding loses a little;
  with ``+ef`` the rank that re-encoded puts that loss in its own residual, so the sum of
  what all ranks delivered still equals the sum of their inputs minus the residuals;
- top-k under ``+ef`` may take the same ring re-sparsifying each hop (``"resparsify"``,
  gTop-k: Shi et al. 2019): a hop decodes the segment's sparse partial sum, adds its own
  (error-fed) segment and keeps the top ``ratio * segment`` values; the dropped mass
  goes to that rank's residual. ``2 (n - 1) / n`` payloads per rank, flat in ``n``,
  where the all-gather's ``n - 1`` grow with it. On the tree (``"resparsify"`` there,
  ``"resparsify_tree"`` on the ring strategy's mesh) each round of recursive doubling
  swaps ``k``-sparse vectors and re-sparsifies their sum: ``log2(n)`` payloads instead
  of ``n - 1``, and ``log2(n)`` re-encodings where the ring makes ``n - 1``. Momentum
  factor masking (``+ef:momentum``) forgets the coordinates of the reduced result.

:func:`path_for` picks the path with the fewest predicted payload bytes per rank
(:func:`path_bytes`; all-gather ``(n - 1) P``, ring ``2 (n - 1) / n P`` for a payload of
``P`` bytes); a tie goes to the all-gather, the exact path; :data:`COARSE` compressors
stay on the all-gather. A *sparse* compressor (top-k) weighs accuracy too: every
re-sparsification keeps ``k`` of a partial sum's coordinates where the all-gather
delivers up to ``n k``, so it takes the path with the fewest re-encodings
(:func:`reencodings`) among those within :data:`EXACT_BUDGET` (twice) the cheapest
path's bytes: the all-gather to world 4 on the ring (5 on the tree), then the tree's
``log2(n)`` rounds, on the ring strategy's mesh as ``"resparsify_tree"``, and the
resparsify ring only where those cost over twice its bytes (world 16 and up).
``config.compression_path`` may force another path that applies (:func:`choose_path`;
the bench compares them). ``CompressedAllreduce.path`` holds the choice and the step
statistics report it (``compression_path``):

==============  ===========  ===========  ===========  ===============  ============
compressor      world 2      world 3      world 4      world 5-8        tree (any)
==============  ===========  ===========  ===========  ===============  ============
fp16/bf16       reduce       reduce       reduce       reduce           reduce
randomk         reduce       reduce       reduce       reduce           reduce
powersgd        reduce       reduce       reduce       reduce           reduce
int8            allgather    recompress   recompress   recompress       allgather
sign            allgather    allgather    allgather    allgather        allgather
topk            allgather    allgather    allgather    allgather        allgather
topk +ef        allgather    allgather    allgather    resparsify_tree  allgather to
                                                                        5, resparsify
==============  ===========  ===========  ===========  ===============  ============

Bitwise agreement: every rank ends with identical bits, because each rank applies the
same decoded bytes with the same ops in the same order (all-gather, and the finished
segments of the recompress/resparsify ring), or holds the bytes the ring/tree made identical before
decoding them (summable).

The weighting rule: the sample count never goes through a compressor. Buckets carry
``n_r g_r``; bucket 0's count is remembered for the step's other buckets and put in each
bucket's state (``ef.scale``) so that error feedback keeps its residual per sample (see
:mod:`sparktrain.compress.feedback`: otherwise a short last batch diverges). On the all-gather
path it rides in each message header (float64) and the counts are summed exactly (on the
recompress ring, hop by hop in the reduce-scatter's headers); on the summable path a
one-element float64 SUM follows bucket 0.

Byte accounting: compressed frames use ``KIND_PAYLOAD``, so the wire counts them in
``wire_bytes_sent`` only, and each call adds to ``raw_bytes_sent`` what the plain
ring/tree would have sent for the uncompressed bucket (its count slot included).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from sparktrain.compress.base import (
    BucketState,
    Compressor,
    Ctx,
    decode_message,
    encode_message,
    message_nbytes,
)
from sparktrain.compress.feedback import SCALE, WORLD, ErrorFeedback, ability
from sparktrain.compress.snapshot import dump_states, load_states
from sparktrain.compress.topk import index_dtype
from sparktrain.errors import CommError, ConfigError
from sparktrain.wire.frames import HEADER_BYTES, KIND_PAYLOAD
from sparktrain.wire.ring import (
    RingAllreduce,
    ring_allgather,
    ring_raw_bytes_sent,
    ring_segments,
)
from sparktrain.wire.tree import TreeAllreduce, tree_raw_bytes_sent

PATHS = ("reduce", "allgather", "recompress", "resparsify", "resparsify_tree")
"""Every path's name, in the order ties are broken (the exact all-gather first among the
non-summable ones); ``compression_path`` takes one of them or ``"auto"``."""

EXACT_BUDGET = 2.0
"""For a sparse compressor, ``auto`` takes the path with the fewest lossy re-encodings
among those that send at most this many times the bytes of the cheapest path: a path
within twice the cheapest keeps at least half the byte ratio the compressor can reach
(top-k 1 %: 25-33x of its 50-67x)."""


def _inner(comp: Compressor) -> Compressor:
    """The core compressor under ``+ef``."""
    return comp.inner if isinstance(comp, ErrorFeedback) else comp


def ring_path(comp: Compressor) -> str | None:
    """The decode-add-encode ring ``comp`` may take, as its class says
    (:attr:`~sparktrain.compress.base.BaseCompressor.ring_path`): ``"recompress"`` (dense
    int8, sign), ``"resparsify"`` (top-k, only under ``+ef``, which keeps what a hop
    drops; without it top-k stays on the exact all-gather) or None."""
    if comp.summable:
        return None
    path = ability(comp, "ring_path")
    if path == "resparsify" and not isinstance(comp, ErrorFeedback):
        return None
    return path if path in ("recompress", "resparsify") else None


def recompressible(comp: Compressor) -> bool:
    """Whether a decode-add-encode ring (recompress or resparsify) applies to ``comp``."""
    return ring_path(comp) is not None


def _rounds(world: int) -> int:
    """Rounds of recursive doubling at ``world``: log2 of its largest power of two."""
    return (1 << (world.bit_length() - 1)).bit_length() - 1


def path_bytes(comp: Compressor, numel: int, world: int, algo: str = "ring") -> dict[str, float]:
    """Predicted compressed payload bytes one rank sends per bucket, for each path
    ``comp`` may take at this world size (message headers left out)."""
    if world <= 1:
        return {"reduce" if comp.summable else "allgather": 0.0}
    payload = comp.payload_nbytes(numel)
    if comp.summable:
        if algo == "ring":
            return {"reduce": 2 * (world - 1) / world * payload}
        return {"reduce": float(_rounds(world) * payload)}
    out = {"allgather": float((world - 1) * payload)}
    ring = ring_path(comp)
    if algo == "ring" and ring is not None:
        # reduce-scatter and all-gather each send n - 1 of the n segments' payloads, each
        # sized for its segment (top-k: k = ratio * segment, a narrower index type)
        segs = [b - a for a, b in ring_segments(numel, world)]
        out[ring] = float(2 * sum(comp.payload_nbytes(m) for m in segs[1:]))
    if ring == "resparsify":
        # one k-sparse payload per round of recursive doubling (folding left out, as
        # for the summable tree): the tree's own path, and on the ring's mesh
        # "resparsify_tree"
        out["resparsify" if algo == "tree" else "resparsify_tree"] = float(_rounds(world) * payload)
    return out


def reencodings(path: str, world: int, algo: str = "ring") -> int:
    """How many times a path may re-encode (lossily) a value on its way: 0 for the exact
    all-gather and the in-place reduction, ``n - 1`` hops on the recompress and resparsify
    rings, one per round of recursive doubling on the tree's resparsify rounds (one more
    where a folded rank encodes its own input first)."""
    if path in ("allgather", "reduce") or world <= 1:
        return 0
    if path == "resparsify_tree" or (path == "resparsify" and algo == "tree"):
        return _rounds(world) + (world & (world - 1) != 0)
    return world - 1


def path_for(comp: Compressor, world: int = 2, algo: str = "ring") -> str:
    """The path ``auto`` takes: ``"reduce"`` (summable, inside the ring/tree),
    ``"allgather"``, ``"recompress"`` (decompress-add-recompress ring), ``"resparsify"``
    (the same ring for top-k under ``+ef``, re-sparsifying each hop; on the tree strategy,
    its rounds of recursive doubling) or ``"resparsify_tree"`` (those rounds on the ring
    strategy's mesh).

    Dense compressors take the path that moves the fewest bytes; ties go to the
    all-gather, which is exact: at world 2 both move one payload, and the ring would
    re-quantise the partial sums (and send two frames instead of one). A sparse
    compressor (its class says ``sparse = True``) keeps only ``k`` of a partial sum's
    coordinates at each re-encoding, where the all-gather delivers up to ``n k``: it
    takes the path with the fewest re-encodings (:func:`reencodings`) among those within
    :data:`EXACT_BUDGET` times the cheapest path's bytes, then the fewest bytes. On
    digits, top-k 1 % lost 1.4-3.3 pp more on the resparsify ring than on the all-gather
    at world 4 (docs/compression.md).
    """
    options = path_bytes(comp, 1 << 20, world, algo)
    if ability(comp, "coarse"):  # forced only by compression_path="recompress"
        options.pop("recompress", None)
    best = min(options.values())
    if getattr(_inner(comp), "sparse", False):
        within = [p for p in PATHS if p in options and options[p] <= EXACT_BUDGET * best]
        return min(within, key=lambda p: (reencodings(p, world, algo), options[p], PATHS.index(p)))
    for name in PATHS:
        if name in options and options[name] <= best:
            return name
    raise AssertionError(options)  # unreachable: options is never empty


def choose_path(comp: Compressor, world: int, algo: str = "ring", want: str = "auto") -> str:
    """``want`` (a ``compression_path`` value) checked against what applies to ``comp``
    at this world size, or :func:`path_for`'s choice for ``"auto"``."""
    if want == "auto":
        return path_for(comp, world, algo)
    options = path_bytes(comp, 1 << 20, world, algo)
    if want not in options:
        raise ConfigError(
            f"compression_path={want!r} does not apply to compression {comp.spec!r} on the "
            f"{algo} at world {world}; the paths that do: "
            f"{', '.join(repr(p) for p in PATHS if p in options)} (or 'auto')"
        )
    return want


def bytes_per_rank(comp: Compressor, numel: int, world: int, algo: str = "ring") -> float:
    """Compressed payload bytes one rank sends per bucket on the chosen path (for docs,
    the bench and tests)."""
    if world == 1:
        return 0.0
    return path_bytes(comp, numel, world, algo)[path_for(comp, world, algo)]


RING_SLOT = "recompress.segments"
TREE_SLOT = "resparsify.rounds"
INLINE_MAX_BYTES = 512 << 10


class CompressedAllreduce:
    """Sum compressed buckets over the ranks of a ring or tree allreduce's mesh."""

    def __init__(
        self,
        comp: Compressor,
        algo: RingAllreduce | TreeAllreduce,
        seed: int = 0,
        path: str = "auto",
    ):
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
        algo_name = "ring" if isinstance(algo, RingAllreduce) else "tree"
        # `path` is config.compression_path: "auto" or a forced path (the bench compares)
        self.path = choose_path(comp, algo.mesh.world_size, algo_name, path)
        self._count = 1.0
        self._doubling: TreeAllreduce | None = None  # "resparsify_tree"'s rounds

    def state_dict(self) -> dict[str, Any]:
        """This rank's compressor state (every bucket's), for a checkpoint shard."""
        return {"spec": self.comp.spec, "count": self._count, "buckets": dump_states(self.states)}

    def load_state_dict(self, data: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s output (same spec, same rank)."""
        if data.get("spec") != self.comp.spec:
            saved, spec = str(data.get("spec")), self.comp.spec
            hint = ""
            if "momentum=" in spec and "momentum=" not in saved and "+ef" in saved:
                # 34.3 moves SGD's momentum into top-k+ef; the checkpoint kept it outside
                keep = saved + (
                    ",momentum=0" if saved.rpartition("+")[2] != "ef" else ":momentum=0"
                )
                hint = (
                    f"; this run moved SGD's momentum into the compressor, compression={keep!r} "
                    "keeps it in the optimizer, as the checkpoint did"
                )
            raise ConfigError(
                f"the checkpoint's compressor state is for {saved!r}, this run compresses "
                f"with {spec!r}: resume with the same compression{hint}"
            )
        self._count = float(data["count"])
        self.states = load_states(data["buckets"])

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
        state.slots[WORLD] = float(self.mesh.world_size)
        length = grads.numel() if raw_length is None else raw_length
        self.mesh.stats.add_sent(0, self._raw_bytes(length, grads.element_size()))
        try:
            if self.path == "reduce":
                total_count = self._reduce(grads, state, count)
            elif self.path == "resparsify_tree" or (
                self.path == "resparsify" and isinstance(self.algo, TreeAllreduce)
            ):
                total_count = self._tree_resparsify(grads, state, count)
            elif self.path in ("recompress", "resparsify"):
                total_count = self._recompress(grads, state, count)
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
        # the payload is encoded, so the bucket itself can be the accumulator: no fresh
        # buffer (a page fault per 4 KiB for large buckets) and no copy back
        acc = grads.reshape(-1)
        acc.zero_()
        total = 0.0
        for data in blobs:
            part, part_ctx, part_count = decode_message(data, numel)
            self.comp.add_into(acc, part, part_ctx)
            total += part_count
        return total

    def _recompress(self, grads: torch.Tensor, state: BucketState, count: float | None) -> float:
        """Decompress-add-recompress ring: a reduce-scatter in which every hop decodes
        the partial sum it receives, adds its own segment (uncompressed) and encodes the
        result for the next hop, then a ring all-gather of the finished segments, each
        encoded once by the rank that finished it. Every rank decodes all finished
        segments, its own included, so all end with the same bits.

        Each encoding loses ``p - D(C(p))`` of the partial sum ``p``. With ``+ef`` the
        rank that encoded it adds that loss to its own residual, so the error-feedback
        identity holds for the sum over ranks: nothing is lost, only delayed. The sample
        count rides in the message headers and is summed along the reduce-scatter.

        The same ring serves top-k under ``+ef`` (``"resparsify"``, gTop-k): each hop
        keeps the top ``ratio * segment`` values of the partial sum, so every payload is
        one segment's ``k``-sparse vector and a rank sends ``2 (n - 1) / n`` payloads
        whatever the world; what a hop drops goes to its residual like any re-encoding.
        """
        comp = self.comp
        ef = comp if isinstance(comp, ErrorFeedback) else None
        inner = _inner(comp)
        if ef is not None:
            x, scale = ef._input(grads, state)
        else:
            x, scale = grads.detach().reshape(-1).to(torch.float32), 1.0
        err = torch.zeros_like(x) if ef is not None else None
        mesh = self.mesh
        n, r = mesh.world_size, mesh.rank
        segs = ring_segments(x.numel(), n)
        # one state per segment: a segment's scratch buffers keep their size
        subs = state.slots.get(RING_SLOT)
        if not isinstance(subs, list) or len(subs) != n:
            subs = [
                BucketState(key=state.key * 4096 + k, seed=state.seed, stream=state.stream)
                for k in range(n)
            ]
            state.slots[RING_SLOT] = subs
        for sub in subs:  # sampled top-k seeds and warm-up schedules read the step
            sub.step = state.step

        def encode(k: int, values: torch.Tensor, carried: float) -> np.ndarray:
            payload, ctx = inner.compress(values, subs[k])
            if err is not None:
                a, b = segs[k]
                err[a:b].add_(values).sub_(inner.decompress(payload, ctx))
            return encode_message(payload, ctx, carried)

        def limit(k: int) -> int:
            a, b = segs[k]
            return message_nbytes((), Ctx(b - a)) + 16 * (b - a) + 4096

        mine = 0.0 if count is None else float(count)
        nxt, prv = (r + 1) % n, (r - 1) % n
        mesh.connect_all((nxt, prv))
        send_conn, recv = mesh.connection(nxt), mesh.connection(prv)
        big = min(INLINE_MAX_BYTES, send_conn.send_buffer_bytes // 4)
        sender = mesh.sender(nxt) if x.numel() // n + HEADER_BYTES > big else None
        put = send_conn.send_array if sender is None else sender.put
        # reduce-scatter: step 0 sends our own segment r; the partial sum of segment
        # (r - s - 1) arrives at step s, and at the last step segment r + 1 is complete
        a, b = segs[r]
        put(encode(r, x[a:b], mine), KIND_PAYLOAD)
        finished = np.zeros(0, dtype=np.uint8)
        for step in range(n - 1):
            k = (r - step - 1) % n
            _, data = recv.recv_bytes(KIND_PAYLOAD, max_bytes=limit(k))
            a, b = segs[k]
            payload, ctx, carried = decode_message(np.frombuffer(data, dtype=np.uint8), b - a)
            partial = inner.decompress(payload, ctx).add_(x[a:b])
            blob = encode(k, partial, carried + mine)
            if step < n - 2:
                put(blob, KIND_PAYLOAD)
            else:
                finished = blob
        if sender is not None:
            sender.flush()
        # all-gather: rank j's blob is segment j + 1
        blobs = ring_allgather(mesh, finished, max(limit(k) for k in range(n)))
        total = 0.0
        out = grads.reshape(-1)
        for j, done in enumerate(blobs):
            k = (j + 1) % n
            a, b = segs[k]
            payload, ctx, carried = decode_message(done, b - a)
            out[a:b].copy_(inner.decompress(payload, ctx))
            total = carried  # every finished segment carries the full count
        if ef is not None and err is not None:
            # residual = err (kept per sample); a rank with no samples this step has no
            # unit to keep it in, so its re-encoding errors (of others' sums) are dropped
            # momentum factor masking (sparse): forget the coordinates the world sent,
            # not those of this rank's partial encodings (it re-encoded others' sums)
            ef._keep(state, x, x - err, scale, mask=out != 0)
        return total if count is not None else 0.0

    def _tree_resparsify(
        self, grads: torch.Tensor, state: BucketState, count: float | None
    ) -> float:
        """gTop-k on recursive doubling: each round swaps ``k``-sparse vectors with the
        partner, both add the two decoded vectors (same bits: IEEE addition commutes) and
        re-sparsify that sum for the next round. ``log2(n)`` payloads per rank instead of
        the all-gather's ``n - 1``.

        Error feedback: after round ``j`` the ``2 ** j`` ranks of a block hold the same
        vector, so each keeps ``1 / 2 ** j`` of its encoding loss (a power of two: exact)
        and the loss is fed back once over the block. A folded rank (worlds that are not
        powers of two) sends its own top-k to its partner, which adds it to its input,
        and receives the result exactly (every nonzero) at the end.
        """
        comp = self.comp
        assert isinstance(comp, ErrorFeedback)
        if self._doubling is None:  # the tree's rounds, on the ring strategy's mesh too
            algo = self.algo
            self._doubling = algo if isinstance(algo, TreeAllreduce) else TreeAllreduce(self.mesh)
        inner = comp.inner
        x, scale = comp._input(grads, state)
        err = torch.zeros_like(x)
        algo, mesh, numel = self._doubling, self.mesh, x.numel()
        n, r, p = mesh.world_size, mesh.rank, algo.pow2
        rounds = p.bit_length() - 1
        # one state per round (and one for a folded rank's own encoding), like the ring's
        # per-segment states: scratch buffers keep their size, seeds stay per round
        subs = state.slots.get(TREE_SLOT)
        if not isinstance(subs, list) or len(subs) != rounds + 1:
            subs = [
                BucketState(key=state.key * 4096 + j, seed=state.seed, stream=state.stream)
                for j in range(rounds + 1)
            ]
            state.slots[TREE_SLOT] = subs
        for sub in subs:
            sub.step = state.step
        limit = message_nbytes((), Ctx(numel)) + 16 * numel + 4096

        def encode(
            j: int, values: torch.Tensor, share: float, carried: float
        ) -> tuple[np.ndarray, torch.Tensor]:
            payload, ctx = inner.compress(values, subs[j])
            sent = inner.decompress(payload, ctx)
            err.add_(values.sub(sent).mul_(share))
            return encode_message(payload, ctx, carried), sent

        def decode(blob: np.ndarray) -> tuple[torch.Tensor, float]:
            payload, ctx, carried = decode_message(blob, numel)
            return inner.decompress(payload, ctx), carried

        carried = 0.0 if count is None else float(count)
        algo.connect()
        if r >= p:  # folded: our top-k to the partner, the finished sum back
            blob, _ = encode(rounds, x, 1.0, carried)
            total, carried = decode(algo.swap(r - p, blob, limit, rounds + 1))
        else:
            cur = x
            if r + p < n:
                part, c = decode(algo.swap(r + p, None, limit, 0))
                cur, carried = x + part, carried + c
            for j in range(rounds):
                blob, sent = encode(j, cur, 1.0 / (1 << j), carried)
                theirs, c = decode(algo.swap(r ^ (1 << j), blob, limit, j + 1))
                cur, carried = sent.add_(theirs), carried + c
            total = cur
            if r + p < n:  # every nonzero of the total, exactly, in top-k's payload form
                idx = torch.nonzero(total).squeeze(1)
                itype = index_dtype(numel)
                payload = (total[idx].numpy(), idx.numpy().astype(itype))
                out_blob = encode_message(payload, Ctx(numel), carried)
                mesh.connection(r + p).send_array(out_blob, KIND_PAYLOAD)
        out = grads.reshape(-1)
        out.copy_(total)
        # the residual is err (per sample); masking as on the ring: what the world sent
        comp._keep(state, x, x - err, scale, mask=out != 0)
        return carried if count is not None else 0.0
