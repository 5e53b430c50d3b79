"""The helpers the integration tests share, in one place: test files import from here,
never from each other.

- scikit-learn's digits as DataFrames (also as 64 pixel columns) and RDDs, a fast
  training config, the summary keys;
- a real Spark standalone cluster on loopback: one master and N workers started from
  pyspark's own ``bin/spark-class``, stopped again whatever happens
  (:class:`StandaloneCluster`), and the process-tree helpers its tests use.

:mod:`tests.integration.attacker` stays a module of its own (its docstring says why).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

from sparktrain import TrainConfig, datasets

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


# ---------------------------------------------------------------------- a standalone cluster
LOOPBACK = "127.0.0.1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def spark_home() -> Path:
    from pyspark.find_spark_home import _find_spark_home

    return Path(_find_spark_home())


def child_pids(pid: int) -> list[int]:
    """Direct children of a process, from /proc (a JVM forks from any of its threads)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            out += [int(p) for p in (task / "children").read_text().split()]
    return out


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        for child in child_pids(todo.pop()):
            out.append(child)
            todo.append(child)
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


class StandaloneCluster:
    """``with StandaloneCluster(workers=2, workdir=...) as cluster: cluster.url``."""

    def __init__(self, workdir: Path, workers: int = 2, cores: int = 1, memory: str = "1g") -> None:
        self.workdir = workdir
        self.workers = workers
        self.cores = cores
        self.memory = memory
        self.port = _free_port()
        self.ui_port = _free_port()
        self.url = f"spark://{LOOPBACK}:{self.port}"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.env = {
            **os.environ,
            "SPARK_LOCAL_IP": LOOPBACK,
            "SPARK_MASTER_HOST": LOOPBACK,
            "PYSPARK_PYTHON": sys.executable,
            "SPARK_WORKER_DIR": str(workdir / "work"),
            "SPARK_LOG_DIR": str(workdir / "logs"),
        }

    def _start(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        log = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115 - lives with the process
        proc = subprocess.Popen(
            [str(spark_home() / "bin" / "spark-class"), *args],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    def __enter__(self) -> StandaloneCluster:
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            self._start(
                "master",
                "org.apache.spark.deploy.master.Master",
                "--host",
                LOOPBACK,
                "--port",
                str(self.port),
                "--webui-port",
                str(self.ui_port),
            )
            self.wait_for(lambda s: s.get("status") == "ALIVE", "the master to start")
            self.worker_procs = [
                self._start(
                    f"worker{i}",
                    "org.apache.spark.deploy.worker.Worker",
                    "--host",
                    LOOPBACK,
                    "--cores",
                    str(self.cores),
                    "--memory",
                    self.memory,
                    "--webui-port",
                    str(_free_port()),
                    self.url,
                )
                for i in range(self.workers)
            ]
            self.wait_for(
                lambda s: s.get("aliveworkers", 0) >= self.workers,
                f"{self.workers} workers to register",
            )
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def state(self) -> dict:
        with urllib.request.urlopen(f"http://{LOOPBACK}:{self.ui_port}/json/", timeout=5) as r:
            return json.loads(r.read())

    def wait_for(self, predicate, what: str, timeout: float = 90.0) -> dict:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        last: object = None
        while time.monotonic() < deadline:
            try:
                state = self.state()
                if predicate(state):
                    return state
            except OSError as exc:
                last = exc
            time.sleep(0.5)
        raise TimeoutError(f"timed out waiting for {what} ({last}); logs in {self.workdir}")

    def executor_pids(self) -> list[int]:
        """JVMs running executors (children of the workers)."""
        return [
            pid
            for w in self.worker_procs
            for pid in descendants(w.pid)
            if "CoarseGrainedExecutorBackend" in cmdline(pid)
        ]

    def stop(self) -> None:
        for proc in reversed(self.procs):
            for pid in [*descendants(proc.pid), proc.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        self.procs.clear()
