"""tree_aggregate's rounds under Spark Connect: the :class:`ConnectBackend` of
:class:`~.driver_round.RoundRunner`.

A Connect session has no RDDs and no broadcasts, so the reduction ``RDD.treeAggregate``
performs is built from DataFrame operations (executor side: :mod:`.task_frames`):

* **Cache** (once): the prepared DataFrame's rows, Arrow-encoded per batch into raw
  buffers (the classic path's encoder), are ``cache()``-d on the server, so every round's
  partitions hold the same rows; the label checks and the validation split run in the
  round's task (they are cheap next to shipping the cached rows to Python, which the RDD
  path's pickled blocks pay too).
* **Round**: ``mapInArrow`` computes each partition's contribution with the shared seqOp
  and writes one partial row; each level of :func:`~.task_frames.tree_levels`
  (``treeAggregate``'s levels for the config's ``aggregation_depth``) is a
  ``groupBy(key % n).applyInArrow`` that merges with the shared combOp; the client folds
  the last rows in key order. Same codec, same compression, the same sums as the RDD path
  up to float32 rounding order.
* **Weights**: every round's closure is part of a request to the server, whose size is
  capped (``spark.connect.grpc.maxInboundMessageSize``, 128 MiB by default). Weights ride
  in the closure up to a quarter of that cap, less the model state that travels with them;
  larger ones are fetched by the tasks from the driver's weights server (the ``delta+``
  mirror's, see :mod:`.driver_weights`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sparktrain.config import TrainConfig
from sparktrain.driver.prepare import PreparedData
from sparktrain.driver.spark_env import SparkEnv
from sparktrain.errors import ConfigError
from sparktrain.strategies.tree_aggregate.codec import Contribution, PayloadCodec
from sparktrain.strategies.tree_aggregate.driver_round import (
    ENCODED_DDL,
    arrow_encoder,
    block_builder,
)
from sparktrain.strategies.tree_aggregate.driver_volume import SparkVolume
from sparktrain.strategies.tree_aggregate.task import Block
from sparktrain.strategies.tree_aggregate.task_frames import (
    PARTIAL_DDL,
    fold_table,
    level_fn,
    partial_fn,
    tree_levels,
)

# Closures (the round's weights and the model state) stay under this share of the
# server's request cap: the plan, the codec and pickling overhead need the rest.
CLOSURE_SHARE = 4


def closure_budget(env: SparkEnv, state_bytes: int) -> int:
    """How many bytes of weights a round's closure may carry next to ``state_bytes`` of
    model state; a state that alone exceeds the share is refused with the way out."""
    cap = env.max_request_bytes() or 0
    share = cap // CLOSURE_SHARE
    if state_bytes > share:
        raise ConfigError(
            f"strategy='tree_aggregate' under Spark Connect ships the model's state "
            f"({state_bytes / 2**20:.1f} MiB) inside each round's request, which may carry "
            f"at most {share / 2**20:.1f} MiB (a quarter of the server's "
            "spark.connect.grpc.maxInboundMessageSize): raise that setting on the Connect "
            "server, use a classic session (broadcasts), or a barrier strategy ('ring', "
            "'tree' or 'ps')"
        )
    return share - state_bytes


def task_partition() -> int:
    """The running task's partition index (executor side; 0 outside a task)."""
    from pyspark import TaskContext

    ctx = TaskContext.get()
    return ctx.partitionId() if ctx is not None else 0


class ConnectBackend:
    """A Spark Connect session: the encoded rows cached as a DataFrame, ``mapInArrow``
    partials and ``groupBy().applyInArrow`` levels (see the module docstring)."""

    can_broadcast = False

    def __init__(
        self,
        prepared: PreparedData,
        cfg: TrainConfig,
        num_outputs: int,
        closure_max_bytes: int,
    ) -> None:
        if prepared.frame is None:  # check_data_kind refuses RDDs before this
            raise ConfigError("under Spark Connect the data must be a DataFrame")
        self.width = prepared.feature_width
        self.build = block_builder(cfg, num_outputs)
        # prepare() shuffled the data into exactly num_workers partitions
        self.partitions = cfg.num_workers
        self.closure_max_bytes = closure_max_bytes
        self.frame = prepared.frame.mapInArrow(arrow_encoder(self.width), ENCODED_DDL).cache()

    def share(self, value: Any) -> Any:
        return value  # no broadcasts: in every round's closure (see closure_budget)

    def broadcast(self, value: Any) -> Any:
        raise ConfigError("a Spark Connect session has no broadcasts")

    def aggregate(
        self,
        seq_op: Callable[[Contribution | None, Block], Contribution | None],
        codec: PayloadCodec,
        depth: int,
    ) -> Contribution | None:
        partial = partial_fn(seq_op, self.width, self.build, task_partition)
        partials = self.frame.mapInArrow(partial, PARTIAL_DDL)
        for groups in tree_levels(self.partitions, depth):
            keyed = partials.select((partials["key"] % groups).alias("group"), "*")
            partials = keyed.groupBy("group").applyInArrow(level_fn(codec), PARTIAL_DDL)
        return fold_table(partials.toArrow(), codec)

    def volume(self, group: str) -> SparkVolume:
        return SparkVolume(None, group)  # no status store to read: spark_* bytes are None

    def release(self) -> None:
        self.frame.unpersist()
