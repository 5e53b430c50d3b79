"""The Spark side of tree_aggregate's driver: the cached data, and one round as one job.

:class:`RoundRunner` runs one round: the weights go out (in the task closure when small,
as a broadcast, as a ``delta+`` download, or fetched from the driver's weights server), a
:class:`RoundBackend` sums the partitions' contributions with the executor side's seqOp
and combOp (:mod:`.task`, :mod:`.codec`), and the round's broadcast is destroyed. Two
backends:

* :class:`ClassicBackend`: :func:`cache_blocks` converts each partition once to a
  validated numpy :class:`~.task.Block` (Arrow -> numpy for a DataFrame, tuples -> numpy
  for an RDD, with the same checks as the barrier path), splits the validation rows off
  and persists it ``MEMORY_AND_DISK``; ``RDD.treeAggregate`` sums.
* :class:`~.driver_frames.ConnectBackend` (Spark Connect: no RDDs, no broadcasts): the
  Arrow-encoded rows cached as a DataFrame, ``mapInArrow`` and grouped ``applyInArrow``
  levels (:mod:`.task_frames`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import pyarrow as pa

from sparktrain.config import TrainConfig
from sparktrain.data.partition_data import PartitionData, check_labels, from_arrow, from_rows
from sparktrain.driver.prepare import PreparedData
from sparktrain.errors import SparkTrainError
from sparktrain.strategies.tree_aggregate.codec import (
    Contribution,
    PayloadCodec,
    make_comb_op,
    zero_stats,
)
from sparktrain.strategies.tree_aggregate.driver_volume import SparkVolume
from sparktrain.strategies.tree_aggregate.driver_weights import WeightsServer
from sparktrain.strategies.tree_aggregate.task import Block, RoundSpec, make_seq_op
from sparktrain.strategies.tree_aggregate.task_frames import decode_parts

if TYPE_CHECKING:
    from pyspark import RDD, SparkContext

# Weights up to this size ride in each round's task closure instead of a broadcast. A
# closure is pickled once per job and shipped with every task, so this trades a
# broadcast's fixed cost for P copies of the weights: worth it for small models only.
CLOSURE_WEIGHTS_MAX_BYTES = 1 << 20
ENCODED_DDL = "part int, x binary, y binary, v binary, w binary"


# ---------------------------------------------------------------------- data, cached once
def cache_blocks(prepared: PreparedData, cfg: TrainConfig, num_outputs: int) -> RDD[Block]:
    """One validated numpy :class:`Block` per partition, persisted MEMORY_AND_DISK (lazy:
    the first action materialises it)."""
    from pyspark import StorageLevel

    width = prepared.feature_width
    check = block_builder(cfg, num_outputs)
    if prepared.frame is not None:
        encoded = prepared.frame.mapInArrow(arrow_encoder(width), ENCODED_DDL)

        def assemble(index: int, rows: Iterable[Any]) -> Iterator[Block]:
            rows = list(rows)
            xs, ys = [r.x for r in rows], [r.y for r in rows]
            vs, ws = [r.v for r in rows], [r.w for r in rows]
            yield check(index, decode_parts(xs, ys, vs, ws, width))

        blocks = encoded.rdd.mapPartitionsWithIndex(assemble)
    else:
        assert prepared.rdd is not None

        def convert(index: int, rows: Iterable[tuple[object, ...]]) -> Iterator[Block]:
            yield check(index, from_rows(rows, width, index))

        blocks = prepared.rdd.mapPartitionsWithIndex(convert)
    return blocks.persist(StorageLevel.MEMORY_AND_DISK)


def arrow_encoder(width: int) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """mapInArrow function: each Arrow batch -> validated numpy -> one row of raw buffers."""

    def encode(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        rank = ctx.partitionId() if ctx is not None else 0
        for batch in batches:
            data = from_arrow([batch], width, rank)
            if data.size == 0:
                continue
            yield pa.RecordBatch.from_pydict(
                {
                    "part": pa.array([rank], pa.int32()),
                    "x": pa.array([data.x.tobytes()], pa.binary()),
                    "y": pa.array([data.y.tobytes()], pa.binary()),
                    "v": pa.array([data.is_val.tobytes()], pa.binary()),
                    "w": pa.array([None if data.w is None else data.w.tobytes()], pa.binary()),
                }
            )

    return encode


def block_builder(cfg: TrainConfig, num_outputs: int) -> Callable[[int, PartitionData], Block]:
    """What a partition's rows go through to become its :class:`Block`: the label check
    and the seeded validation split (once for the RDD cache; every round for the
    DataFrame cache, which holds the encoded rows)."""
    loss, fraction, seed = cfg.loss, cfg.validation_fraction, cfg.seed

    def build(index: int, data: PartitionData) -> Block:
        if loss == "cross_entropy":
            check_labels(data.y, num_outputs, index)
        train, val = data.split(fraction, seed, index)
        return Block(index, train, val)

    return build


# ---------------------------------------------------------------------- the backends
class RoundBackend(Protocol):
    """How a round reaches the partitions and how their contributions are summed."""

    partitions: int
    closure_max_bytes: int  # exact weights up to this size ride in the round's closure
    can_broadcast: bool  # larger ones: a broadcast, else the driver's weights server

    def share(self, value: Any) -> Any:
        """A job-long value for the tasks (the model's state): a broadcast, or the value
        itself (then it travels in every round's closure)."""

    def broadcast(self, value: Any) -> Any:
        """A round's broadcast of ``value`` (only when :attr:`can_broadcast`)."""

    def aggregate(
        self,
        seq_op: Callable[[Contribution | None, Block], Contribution | None],
        codec: PayloadCodec,
        depth: int,
    ) -> Contribution | None:
        """The sum of every partition's ``seq_op(None, block)`` (``treeAggregate``'s)."""

    def volume(self, group: str) -> SparkVolume:
        """Spark's traffic counts of a job group (unavailable without a SparkContext)."""

    def release(self) -> None:
        """Drop the cached data and the shared values (not blocking)."""


class ClassicBackend:
    """A classic session: the :func:`cache_blocks` RDD, broadcasts, ``treeAggregate``."""

    can_broadcast = True

    def __init__(
        self,
        sc: SparkContext,
        blocks: RDD[Block],
        closure_max_bytes: int = CLOSURE_WEIGHTS_MAX_BYTES,
    ) -> None:
        self.sc = sc
        self.blocks = blocks
        self.partitions = blocks.getNumPartitions()
        self.closure_max_bytes = closure_max_bytes
        self._shared: list[Any] = []

    def share(self, value: Any) -> Any:
        handle = self.sc.broadcast(value)
        self._shared.append(handle)
        return handle

    def broadcast(self, value: Any) -> Any:
        return self.sc.broadcast(value)

    def aggregate(
        self,
        seq_op: Callable[[Contribution | None, Block], Contribution | None],
        codec: PayloadCodec,
        depth: int,
    ) -> Contribution | None:
        result: Contribution | None = self.blocks.treeAggregate(
            None, seq_op, make_comb_op(codec), depth=depth
        )
        return result

    def volume(self, group: str) -> SparkVolume:
        return SparkVolume(self.sc, group)

    def release(self) -> None:
        self.blocks.unpersist(blocking=False)
        for handle in self._shared:
            handle.destroy(blocking=False)


# ---------------------------------------------------------------------- one round
class RoundRunner:
    """Runs rounds through a :class:`RoundBackend`: weights out (in the closure, a
    broadcast, a ``delta+`` download or a fetch from the weights server), the sum, and
    the round's broadcast destroyed. ``spec`` may be replaced between rounds (the sizing
    round runs with a spec of its own)."""

    def __init__(
        self,
        backend: RoundBackend,
        spec: RoundSpec,
        downloads: WeightsServer | None = None,
    ) -> None:
        self.backend = backend
        self.spec = spec
        self.downloads = downloads  # delta+ specs, or large weights without broadcasts
        self.broadcast_bytes = 0
        self.closure_bytes = 0
        self.served_bytes = 0  # exact weights the tasks fetch from the weights server
        self.rounds = 0

    def run(
        self, weights: np.ndarray, round_index: int, train: bool = True, evaluate: bool = False
    ) -> tuple[np.ndarray | None, np.ndarray]:
        """The summed contribution of every partition: (decoded vector or None, stats)."""
        spec = self.spec
        backend = self.backend
        handle: Any = None
        broadcast = None
        small = weights.nbytes <= backend.closure_max_bytes
        delta = self.downloads is not None and self.downloads.compresses
        exact = not delta or self.rounds == 0 or not train
        if not exact:
            assert self.downloads is not None
            handle = self.downloads.next(weights)  # C(w - mirror); tasks add it to theirs
            self.closure_bytes += handle.message.nbytes if handle.message is not None else 0
        elif small:
            # pickled with the closure when the job is submitted, i.e. inside
            # aggregate below: the caller may reuse its buffer after we return
            handle = weights
            self.closure_bytes += weights.nbytes
        elif backend.can_broadcast:
            handle = broadcast = backend.broadcast(weights)
            self.broadcast_bytes += weights.nbytes
        elif self.downloads is None:
            raise SparkTrainError(
                "the weights are too large for the round's closure and there is no weights "
                "server to fetch them from; this is a bug"
            )
        else:
            self.served_bytes += weights.nbytes  # the tasks fetch them: handle stays None
        if self.downloads is not None and exact:
            # the first round's mirror starts exact; the final evaluation's metric is then
            # the driver model's own, not its compressed copy's. Without a closure copy or
            # a broadcast the tasks fetch the exact weights from the server.
            handle = self.downloads.next(weights, handle, force=True)
        try:
            seq_op = make_seq_op(spec, handle, round_index, train, evaluate)
            out = backend.aggregate(seq_op, spec.codec, spec.config.aggregation_depth)
        finally:
            if broadcast is not None:
                broadcast.destroy(blocking=False)
        self.rounds += 1
        if out is None:
            return None, zero_stats(spec.size_slots)
        payload, stats = out
        return (spec.codec.decode(payload) if payload is not None else None), stats
