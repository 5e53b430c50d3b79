"""The helpers the integration tests share, in one place: test files import from here,
never from each other.

- scikit-learn's digits as DataFrames (also as 64 pixel columns) and RDDs, a fast
  training config, the summary keys;
- a real Spark standalone cluster on loopback: one master and N workers started from
  pyspark's own ``bin/spark-class``, stopped again whatever happens
  (:class:`StandaloneCluster`, from :mod:`tests.cluster.standalone`), and the
  process-tree helpers its tests use.

:mod:`tests.integration.attacker` stays a module of its own (its docstring says why).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from sparktrain import TrainConfig, datasets
from sparktrain.driver import occupancy

# The standalone cluster and its process-tree helpers: one implementation, shared with the
# multi-host bench (tests/cluster/netcluster.py); re-exported for the tests.
from tests.cluster.standalone import LOOPBACK as LOOPBACK
from tests.cluster.standalone import StandaloneCluster as StandaloneCluster
from tests.cluster.standalone import child_pids as child_pids
from tests.cluster.standalone import cmdline as cmdline
from tests.cluster.standalone import descendants as descendants
from tests.cluster.standalone import spark_home as spark_home

DIGITS_MODEL = "sparktrain.models:digits_mlp"

# Every training path's summary has these keys (docs/summary.md).
SUMMARY_KEYS = frozenset(
    {
        "strategy",
        "compression",
        "world_size",
        "epochs",
        "train_samples",
        "train_rows_per_worker",
        "steps_per_epoch",
        "num_parameters",
        "final_loss",
        "metric_name",
        "metric_value",
        "wall_s",
        "stage_s",
        "train_s",
        "comm_s",
        "samples_per_s",
        "bytes_sent",
        "wire_bytes",
        "compression_ratio",
        "restarts",
        "replicas_in_sync",
        "history",
        "config",
    }
)


@functools.cache
def digits() -> datasets.Split:
    return datasets.digits()


def digits_frames(spark, partitions: int = 2, vector: bool = False):  # type: ignore[no-untyped-def]
    split = digits()
    train = datasets.to_dataframe(spark, split.x_train, split.y_train, partitions)
    test = datasets.to_dataframe(spark, split.x_test, split.y_test, partitions)
    if vector:
        from pyspark.ml.functions import array_to_vector

        train = train.select(array_to_vector("features").alias("pixels"), "label")
        test = test.select(array_to_vector("features").alias("pixels"), "label")
    return train, test


def digits_rdd(spark, partitions: int = 2):  # type: ignore[no-untyped-def]
    split = digits()
    rows = [(x, float(y)) for x, y in zip(split.x_train, split.y_train, strict=True)]
    return spark.sparkContext.parallelize(rows, partitions)


PIXELS = [f"p{i}" for i in range(64)]


def pixel_frames(spark):  # type: ignore[no-untyped-def]
    """Digits as DataFrames with an id, 64 double pixel columns and a double label."""
    import pandas as pd

    split = digits()

    def frame(x: np.ndarray, y: np.ndarray, offset: int):  # type: ignore[no-untyped-def]
        pdf = pd.DataFrame(x.astype(np.float64), columns=PIXELS)
        pdf.insert(0, "id", np.arange(offset, offset + len(y)))
        pdf["label"] = y.astype(np.float64)
        return spark.createDataFrame(pdf).repartition(2)

    return frame(split.x_train, split.y_train, 0), frame(split.x_test, split.y_test, 10**6)


def digits_pipeline_of(**classifier_params):  # type: ignore[no-untyped-def]
    """VectorAssembler -> StandardScaler -> TorchClassifier over :func:`pixel_frames`'
    columns (adam, 10 epochs, ring; ``classifier_params`` override)."""
    from pyspark.ml import Pipeline
    from pyspark.ml.feature import StandardScaler, VectorAssembler

    from sparktrain.ml import TorchClassifier

    params = {
        "modelFn": DIGITS_MODEL,
        "featuresCol": "scaled",
        "optimizer": "adam",
        "learningRate": 0.003,
        "maxEpochs": 10,
        "batchSize": 32,
        "strategy": "ring",
        **classifier_params,
    }
    return Pipeline(
        stages=[
            VectorAssembler(inputCols=PIXELS, outputCol="raw"),
            StandardScaler(inputCol="raw", outputCol="scaled"),
            TorchClassifier(**params),
        ]
    )


def fast_config(**overrides) -> TrainConfig:  # type: ignore[no-untyped-def]
    base = {
        "epochs": 20,
        "batch_size": 32,
        "lr": 0.05,
        "optimizer": "sgd",
        "optimizer_kwargs": {"momentum": 0.9},
        "num_workers": 2,
        "progress": False,
        "comm_timeout": 30.0,
    }
    return TrainConfig(**{**base, **overrides})


def accuracy(model, x: np.ndarray, y: np.ndarray) -> float:  # type: ignore[no-untyped-def]
    import torch

    with torch.no_grad():
        return float((model(torch.from_numpy(x)).argmax(1).numpy() == y).mean())


CALL_BOUND_S = 165.0
"""A test's torch_run calls must have returned by then, or Spark's jobs are cancelled
(:func:`bounded`), before the pytest-timeout above interrupts the driver mid-call."""


@contextlib.contextmanager
def bounded(spark: Any, seconds: float = CALL_BOUND_S) -> Iterator[None]:
    """Cancel every Spark job if the block has not returned after ``seconds``, saying
    what ran: a torch_run that waits on a stage which never ends (a rank that never
    comes, a task deadlocked on its way out) then raises, and leaves no task holding one
    of local[2]'s two slots for the tests after it."""

    def cancel() -> None:
        sc = spark.sparkContext
        state = occupancy.describe(occupancy.active_jobs(sc), occupancy.running_tasks(sc))
        print(f"\nno return after {seconds:g} s; cancelling: {state}", file=sys.__stderr__)
        sc.cancelAllJobs()

    timer = threading.Timer(seconds, cancel)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def rank_1_gives_up(path: str) -> Any:
    """A ``train_fn`` that appends its rank to ``path`` (one line per rank and attempt),
    then raises ``ValueError`` on rank 1 while rank 0 waits for it in an allreduce: how
    often the user's own error ran (issue 35.6)."""

    def train_fn(ctx: Any) -> None:
        import torch

        with open(path, "a") as f:
            f.write(f"{ctx.rank}\n")
        if ctx.rank == 1:
            raise ValueError("rank one gives up\nfor good")
        ctx.allreduce(torch.zeros(1))

    return train_fn


def pyspark_over_unix_sockets_works(spark: Any) -> None:
    """Python workers, accumulators and Arrow collection work over Unix domain sockets
    (``spark.python.unix.domain.socket.enabled``), and the accumulator server has no TCP
    port to connect to."""
    from sparktrain.driver.spark_env import UNIX_SOCKETS, tcp_accumulator_address

    sc = spark.sparkContext
    assert sc.getConf().get(UNIX_SOCKETS) == "true"
    assert tcp_accumulator_address(sc) is None  # a Unix socket: no port to connect to
    total = sc.accumulator(0)
    sc.parallelize(range(10), 2).foreach(lambda x: total.add(x))  # workers -> accumulator
    assert total.value == 45
    assert spark.range(100).toArrow().num_rows == 100  # Arrow collection to the driver
