"""Starting a SparkSession the way sparktrain expects: on loopback, quiet, with a bounded
barrier timeout. Only the CLI, jobs and tests start sessions; the Trainer uses the active
one."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from importlib import resources
from typing import TYPE_CHECKING

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
    # Python workers fork from a daemon that has torch loaded (launch/daemon.py)
    "spark.python.daemon.module": "sparktrain.launch.daemon",
}


def log4j_options() -> str:
    """JVM option that points log4j2 at sparktrain's quiet configuration."""
    path = resources.files("sparktrain").joinpath("resources/log4j2.properties")
    return f"-Dlog4j2.configurationFile={path}"


def _import_torch() -> None:
    with contextlib.suppress(ImportError):  # the fit's own import then says what is wrong
        import torch  # noqa: F401


def get_or_create_session(
    master: str | None = None,
    app_name: str = "sparktrain",
    conf: dict[str, str] | None = None,
    warm_workers: bool = True,
) -> SparkSession:
    """The active session, or a new one with sparktrain's loopback defaults.

    While a new session's JVM starts, torch is imported in a background thread (it is
    needed by any fit, and the two overlap). With ``warm_workers``, a new session then
    starts its executors' Python daemon in the background
    (:mod:`sparktrain.launch.warmup`), while the caller loads its data.
    """
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None and master is None:
        return active
    os.environ.setdefault("SPARK_LOCAL_IP", LOOPBACK)
    # Python workers run the driver's interpreter unless the user chose another: the
    # executors then see the same torch and sparktrain.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    if "torch" not in sys.modules:
        # the JVM takes seconds to start; the driver needs torch for any fit
        threading.Thread(target=_import_torch, name="sparktrain-import-torch", daemon=True).start()
    builder = SparkSession.builder.appName(app_name)
    if master:
        builder = builder.master(master)
    settings = {**DEFAULTS, "spark.driver.extraJavaOptions": log4j_options(), **(conf or {})}
    for key, value in settings.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    from sparktrain.launch.spark_env import is_connect

    if is_connect(spark):  # SPARK_REMOTE set: a Connect client has no context to tune
        return spark
    spark.sparkContext.setLogLevel("WARN")
    if warm_workers:
        from sparktrain.launch import warmup

        warmup.start(spark)
    return spark
