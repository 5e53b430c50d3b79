"""Starting a SparkSession the way sparktrain expects: on loopback, quiet, with a bounded
barrier timeout. Only the CLI, jobs and tests start sessions; the Trainer uses the active
one."""

from __future__ import annotations

import contextlib
import importlib
import os
import socket
import sys
import threading
from importlib import resources
from typing import TYPE_CHECKING

from sparktrain.driver.spark_env import UNIX_SOCKETS

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

LOOPBACK = "127.0.0.1"

# Applied unless the caller (or spark-submit) already set them.
DEFAULTS: dict[str, str] = {
    "spark.driver.host": LOOPBACK,
    "spark.driver.bindAddress": LOOPBACK,
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.barrier.sync.timeout": "600s",
    "spark.sql.execution.arrow.pyspark.enabled": "true",
    "spark.sql.shuffle.partitions": "4",
    "spark.python.worker.reuse": "true",
    # Python workers fork from a daemon that has torch loaded (driver/daemon.py)
    "spark.python.daemon.module": "sparktrain.driver.daemon",
}
if hasattr(socket, "AF_UNIX"):
    # PySpark's accumulator server on a Unix socket, not a loopback TCP port: the TCP one
    # serves one connection at a time, and a stranger's silent connection made before
    # Spark's own stalls every Python job of the driver (docs/security.md). The JVM's
    # sockets to the Python workers move to Unix sockets too.
    DEFAULTS[UNIX_SOCKETS] = "true"


def log4j_options() -> str:
    """JVM option that points log4j2 at sparktrain's quiet configuration."""
    path = resources.files("sparktrain").joinpath("resources/log4j2.properties")
    return f"-Dlog4j2.configurationFile={path}"


# What the first fit imports in the driver besides pyspark, most needed first: torch,
# sparktrain's driver half (the Trainer, the stage runner, the strategies), pandas and
# pyarrow (pyspark's Arrow paths: the warm-up job, the training stage's collect) and
# pyspark.ml (the data preparation's vector columns; it brings scipy). Imported while a
# new session's JVM starts instead of after it: each takes seconds on the way to the
# first fit, and the JVM's start leaves the driver's CPU idle.
PRELOAD: tuple[str, ...] = (
    "torch",
    "sparktrain.trainer",
    "pyarrow",
    "pandas",
    "pyspark.sql.pandas.conversion",
    "pyspark.ml.functions",
)
PRELOAD_WAIT_S = 120.0  # the longest a new session waits for the preloading thread


def _preload(modules: tuple[str, ...]) -> None:
    for name in modules:
        # a failure is the fit's to report, where the module is imported again
        with contextlib.suppress(Exception):
            importlib.import_module(name)


def _quiet_submitted_driver(builder: SparkSession.Builder) -> SparkSession.Builder:
    """Under spark-submit the driver JVM runs already (our log4j2 file cannot apply):
    a quiet start for the SparkContext all the same (see
    :func:`sparktrain.driver.console.submitted_driver_conf`); unchanged otherwise."""
    from sparktrain.driver.console import submitted_driver_conf

    for key, value in submitted_driver_conf().items():
        builder = builder.config(key, value)
    return builder


def get_or_create_session(
    master: str | None = None,
    app_name: str = "sparktrain",
    conf: dict[str, str] | None = None,
    warm_workers: bool = True,
) -> SparkSession:
    """The active session, or a new one with sparktrain's loopback defaults.

    While a new session's JVM starts, a background thread imports what the first fit
    needs in the driver (``PRELOAD``: torch, sparktrain's driver modules, pandas, pyarrow,
    pyspark.ml), so the two overlap; the session is returned once that thread is done
    (at most ``PRELOAD_WAIT_S`` later), so no import runs concurrently with the caller's.
    With ``warm_workers``, a new session then starts its executors' Python daemon in
    the background (:mod:`sparktrain.driver.warmup`), while the caller loads its data.
    """
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None and master is None:
        return active
    os.environ.setdefault("SPARK_LOCAL_IP", LOOPBACK)
    # Python workers run the driver's interpreter unless the user chose another: the
    # executors then see the same torch and sparktrain.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    preloading = None
    missing = tuple(name for name in PRELOAD if name not in sys.modules)
    if missing:
        # the JVM takes seconds to start; the driver needs these for any fit
        preloading = threading.Thread(
            target=_preload, args=(missing,), name="sparktrain-preload", daemon=True
        )
        preloading.start()
    builder = SparkSession.builder.appName(app_name)
    if master:
        builder = builder.master(master)
    settings = {**DEFAULTS, "spark.driver.extraJavaOptions": log4j_options(), **(conf or {})}
    for key, value in settings.items():
        builder = builder.config(key, value)
    builder = _quiet_submitted_driver(builder)
    spark = builder.getOrCreate()
    if preloading is not None:
        preloading.join(timeout=PRELOAD_WAIT_S)
    from sparktrain.driver.spark_env import is_connect

    if is_connect(spark):  # SPARK_REMOTE set: a Connect client has no context to tune
        return spark
    spark.sparkContext.setLogLevel("WARN")
    if warm_workers:
        from sparktrain.driver import warmup

        warmup.start(spark)
    return spark
