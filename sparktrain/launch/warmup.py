"""Start the executors' Python daemon while the driver is still busy in Python.

The first Python task of an application waits for its executor to start the Python
daemon, which imports torch before it forks (:mod:`sparktrain.launch.daemon`): about
2 s of CPU, on the path to the first training step of the first ``fit()``. Right after
a new session starts, the driver usually spends seconds in its own Python (loading
data, building DataFrames) while the executors' cores sit idle. :func:`start` submits a
one-task ``mapInArrow`` job in a background thread then, so the daemon (and one Python worker)
are up by the time the training stage asks for them.

Once per application; a failed warm-up is logged and ignored, since it only ever saves
time: the training stage starts the daemon by itself. (Started from ``fit()`` instead,
the warm-up competed with the data-preparation jobs and delayed the stage: measured.)
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import SparkSession

log = logging.getLogger(__name__)

_started: set[str] = set()  # applicationIds
_lock = threading.Lock()


def _same(batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    yield from batches


def start(spark: SparkSession) -> threading.Thread | None:
    """Submit the warm-up job in a daemon thread, once per application; returns the
    thread (``None`` if this application was warmed before)."""
    sc = spark.sparkContext
    app = sc.applicationId
    with _lock:
        if app in _started:
            return None
        _started.add(app)

    def run() -> None:
        try:
            sc.setJobDescription("sparktrain: start the Python workers")
            # mapInArrow, as the training stage: it also loads the Arrow paths of the JVM
            # and of the worker (an RDD job warmed less: measured, 1 s less saved)
            spark.range(1, numPartitions=1).mapInArrow(_same, "id long").collect()
        except Exception as exc:  # only ever a saving
            log.debug("warming the Python workers failed: %s", exc)

    thread = threading.Thread(target=run, name="sparktrain-warmup", daemon=True)
    thread.start()
    return thread
