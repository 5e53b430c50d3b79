"""Start the executors' Python daemon while the driver is still busy in Python.

The first Python task of an application waits for its executor to start the Python
daemon, which imports torch before it forks (:mod:`sparktrain.driver.daemon`): about
2 s of CPU, on the path to the first training step of the first ``fit()``. Right after
a new session starts, the driver usually spends seconds in its own Python (loading
data, building DataFrames) while the executors' cores sit idle. :func:`start` submits a
one-task ``mapInArrow`` job without waiting for it, so the daemon (and one Python worker)
are up by the time the training stage asks for them.

Once per application; a failed warm-up is logged and ignored, since it only ever saves
time: the training stage starts the daemon by itself. (Started from ``fit()`` instead,
the warm-up competed with the data-preparation jobs and delayed the stage: measured.)

A fit's data preparation ends with :func:`settle`, which waits for the warm-up if it
still runs (the stage needs the same daemon), whether the preparation succeeded or not:
a session stopped right after a fit then never stops a running warm-up, which printed
Spark's "Block broadcast_0 does not exist" and "Python worker exited unexpectedly".
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

log = logging.getLogger(__name__)

_started: set[str] = set()  # applicationIds
_running: dict[str, Any] = {}  # applicationId -> the warm-up job's JavaFutureAction
_lock = threading.Lock()
SETTLE_S = 120.0  # the longest a fit waits for the warm-up to end


def _same(batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    yield from batches


def start(spark: SparkSession) -> bool:
    """Submit the warm-up job without waiting for it, once per application; returns
    whether it was submitted now.

    Planning it runs in the caller's thread (about 2 s in a fresh process: the first
    DataFrame plan, pyspark's Arrow imports; costs the first fit would pay anyway),
    then the JVM runs the job while the caller goes on (``countAsync``). From a
    background thread instead, the submission waited for the caller's imports (the
    GIL) and the job started only when ``fit()`` did.
    """
    sc = spark.sparkContext
    app = sc.applicationId
    with _lock:
        if app in _started:
            return False
        _started.add(app)
    previous = sc.getLocalProperty("spark.job.description")
    try:
        sc.setJobDescription("sparktrain: start the Python workers")
        # mapInArrow, as the training stage: it also loads the JVM's and the worker's
        # Arrow paths (measured: fit() 5.0 s after it, 8.0 s after an RDD job's warm-up)
        frame = spark.range(1, numPartitions=1).mapInArrow(_same, "id long")
        future = frame._jdf.javaRDD().countAsync()
        with _lock:
            _running[app] = future
    except Exception as exc:  # only ever a saving
        log.debug("warming the Python workers failed: %s", exc)
        return False
    finally:
        sc.setLocalProperty("spark.job.description", previous)  # type: ignore[arg-type]
    return True


def settle(sc: SparkContext) -> None:
    """Wait until the warm-up job of ``sc``'s application has ended (at most
    ``SETTLE_S``, then it is cancelled), so that a ``spark.stop()`` right after the fit
    finds no warm-up task to break. The wait costs the training stage nothing (it needs
    the same Python daemon); a fit that failed on the driver returns that much later.
    Cancelling instead would not be quicker: the job ends at once, but its task only
    once the daemon it waits for is up, and a task still running at ``stop()`` is what
    printed."""
    with _lock:
        future = _running.pop(sc.applicationId, None)
    if future is None:
        return
    deadline = time.monotonic() + SETTLE_S
    try:
        while not future.isDone() and time.monotonic() < deadline:
            time.sleep(0.05)
        if not future.isDone():
            future.cancel(True)
    except Exception as exc:  # the context stopped meanwhile: nothing left to settle
        log.debug("settling the warm-up job failed: %s", exc)
