"""The Spark side of tree_aggregate's driver: the cached blocks, and one round as one job.

:func:`cache_blocks` converts each partition once to a validated numpy
:class:`~sparktrain.worker.rounds.Block` (Arrow -> numpy for a DataFrame, tuples -> numpy
for an RDD, with the same checks as the barrier path), splits the validation rows off and
persists it ``MEMORY_AND_DISK``. :class:`RoundRunner` runs one round over those blocks:
the weights go out (in the task closure when small, as a broadcast, or as a ``delta+``
download), ``RDD.treeAggregate`` sums the partitions' contributions with the executor
side's seqOp and combOp (:mod:`sparktrain.worker.rounds`,
:mod:`sparktrain.worker.round_codec`), and the round's broadcast is destroyed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from sparktrain.config import TrainConfig
from sparktrain.launch.prepare import PreparedData
from sparktrain.launch.weights_server import WeightsServer
from sparktrain.worker.data import PartitionData, check_labels, from_arrow, from_rows
from sparktrain.worker.round_codec import make_comb_op, zero_stats
from sparktrain.worker.rounds import Block, RoundSpec, make_seq_op

if TYPE_CHECKING:
    from pyspark import RDD, SparkContext

# Weights up to this size ride in each round's task closure instead of a broadcast. A
# closure is pickled once per job and shipped with every task, so this trades a
# broadcast's fixed cost for P copies of the weights: worth it for small models only.
CLOSURE_WEIGHTS_MAX_BYTES = 1 << 20
_ENCODED_DDL = "part int, x binary, y binary, v binary, w binary"


# ---------------------------------------------------------------------- data, cached once
def cache_blocks(prepared: PreparedData, cfg: TrainConfig, num_outputs: int) -> RDD[Block]:
    """One validated numpy :class:`Block` per partition, persisted MEMORY_AND_DISK (lazy:
    the first action materialises it)."""
    from pyspark import StorageLevel

    width = prepared.feature_width
    check = _block_builder(cfg, num_outputs)
    if prepared.frame is not None:
        encoded = prepared.frame.mapInArrow(_arrow_encoder(width), _ENCODED_DDL)

        def assemble(index: int, rows: Iterable[Any]) -> Iterator[Block]:
            parts = [
                PartitionData(
                    np.frombuffer(r.x, dtype=np.float32).reshape(-1, width),
                    np.frombuffer(r.y, dtype=np.float64),
                    np.frombuffer(r.v, dtype=np.bool_),
                    None if r.w is None else np.frombuffer(r.w, dtype=np.float64),
                )
                for r in rows
            ]
            yield check(index, _concat(parts, width))

        blocks = encoded.rdd.mapPartitionsWithIndex(assemble)
    else:
        assert prepared.rdd is not None

        def convert(index: int, rows: Iterable[tuple[object, ...]]) -> Iterator[Block]:
            yield check(index, from_rows(rows, width, index))

        blocks = prepared.rdd.mapPartitionsWithIndex(convert)
    return blocks.persist(StorageLevel.MEMORY_AND_DISK)


def _arrow_encoder(width: int) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
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


def _concat(parts: list[PartitionData], width: int) -> PartitionData:
    return PartitionData.concat(parts, width)  # carries sample weights too


def _block_builder(cfg: TrainConfig, num_outputs: int) -> Callable[[int, PartitionData], Block]:
    loss, fraction, seed = cfg.loss, cfg.validation_fraction, cfg.seed

    def build(index: int, data: PartitionData) -> Block:
        if loss == "cross_entropy":
            check_labels(data.y, num_outputs, index)
        train, val = data.split(fraction, seed, index)
        return Block(index, train, val)

    return build


# ---------------------------------------------------------------------- one round
class RoundRunner:
    """Runs rounds over the cached blocks: weights out (in the closure or a broadcast),
    treeAggregate, unbroadcast. ``spec`` may be replaced between rounds (the sizing round
    runs with a spec of its own)."""

    def __init__(
        self,
        sc: SparkContext,
        blocks: RDD[Block],
        spec: RoundSpec,
        closure_max_bytes: int = CLOSURE_WEIGHTS_MAX_BYTES,
        downloads: WeightsServer | None = None,
    ) -> None:
        self.sc = sc
        self.blocks = blocks
        self.spec = spec
        self.closure_max_bytes = closure_max_bytes
        self.downloads = downloads  # delta+ specs: compressed weight downloads
        self.broadcast_bytes = 0
        self.closure_bytes = 0
        self.rounds = 0

    def run(
        self, weights: np.ndarray, round_index: int, train: bool = True, evaluate: bool = False
    ) -> tuple[np.ndarray | None, np.ndarray]:
        """The summed contribution of every partition: (decoded vector or None, stats)."""
        spec = self.spec
        handle: Any
        broadcast = None
        small = weights.nbytes <= self.closure_max_bytes
        exact = self.downloads is None or self.rounds == 0 or not train
        if not exact:
            assert self.downloads is not None
            handle = self.downloads.next(weights)  # C(w - mirror); tasks add it to theirs
            self.closure_bytes += handle.message.nbytes if handle.message is not None else 0
        elif small:
            # pickled with the closure when the job is submitted, i.e. inside
            # treeAggregate below: the caller may reuse its buffer after we return
            handle = weights
            self.closure_bytes += weights.nbytes
        else:
            handle = broadcast = self.sc.broadcast(weights)
            self.broadcast_bytes += weights.nbytes
        if self.downloads is not None and exact:
            # the first round's mirror starts exact; the final evaluation's metric is then
            # the driver model's own, not its compressed copy's
            handle = self.downloads.next(weights, broadcast, force=True)
        try:
            out = self.blocks.treeAggregate(
                None,
                make_seq_op(spec, handle, round_index, train, evaluate),
                make_comb_op(spec.codec),
                depth=spec.config.aggregation_depth,
            )
        finally:
            if broadcast is not None:
                broadcast.destroy(blocking=False)
        self.rounds += 1
        if out is None:
            return None, zero_stats(spec.size_slots)
        payload, stats = out
        return (spec.codec.decode(payload) if payload is not None else None), stats
