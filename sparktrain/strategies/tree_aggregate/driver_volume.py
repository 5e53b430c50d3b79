"""Spark's own view of a job group's traffic, for tree_aggregate's summary.

Shuffle write/read and task-result bytes per stage are read from the driver's
``AppStatusStore`` through Py4J (the data behind the UI and the REST API); it works with
the UI disabled. Spark's status store keeps only the last ``spark.ui.retainedStages``
(1000) stages, so the driver polls it every few rounds.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark import SparkContext

log = logging.getLogger(__name__)


class SparkVolume:
    """Shuffle and task-result bytes of a job group's stages, from the driver's
    ``AppStatusStore`` (the data behind the UI and the REST API; it is kept even with
    ``spark.ui.enabled=false``). Best effort: any Py4J surprise turns it off, not the run."""

    def __init__(self, sc: SparkContext | None, group: str) -> None:
        """``sc=None`` (Spark Connect: no status store to read) reports every figure as
        None."""
        self.group = group
        self.shuffle_write = 0
        self.shuffle_read = 0
        self.result_bytes = 0
        self.failed_tasks = 0
        self.stages = 0
        self.available = sc is not None
        self._done: set[int] = set()
        self._sc = sc

    def poll(self, final: bool = False) -> None:
        if not self.available:
            return
        try:
            self._poll(final)
        except Exception as exc:  # Spark Connect, another Spark version...
            log.info("Spark's stage metrics are unavailable (%s); spark_* bytes not reported", exc)
            self.available = False

    def _poll(self, final: bool) -> None:
        sc = self._sc
        assert sc is not None
        jsc = sc._jsc.sc()
        if final:
            jsc.listenerBus().waitUntilEmpty(10_000)
        tracker = sc.statusTracker()
        store = jsc.statusStore()
        no_tasks = sc._jvm.java.util.ArrayList()  # type: ignore[union-attr]
        no_quantiles = sc._gateway.new_array(sc._jvm.double, 0)  # type: ignore[union-attr]
        for job in tracker.getJobIdsForGroup(self.group):
            if job in self._done:
                continue
            info = tracker.getJobInfo(job)
            if info is None or info.status not in ("SUCCEEDED", "FAILED"):
                continue
            self._done.add(job)
            for stage in info.stageIds:
                try:
                    attempts = store.stageData(stage, False, no_tasks, False, no_quantiles)
                except Exception:  # skipped or evicted stage
                    continue
                for i in range(attempts.size()):
                    data = attempts.apply(i)
                    self.shuffle_write += int(data.shuffleWriteBytes())
                    self.shuffle_read += int(data.shuffleReadBytes())
                    self.result_bytes += int(data.resultSize())
                    self.failed_tasks += int(data.numFailedTasks())
                    self.stages += 1

    def as_dict(self) -> dict[str, Any]:
        if not self.available:
            return {
                "spark_shuffle_bytes": None,
                "spark_shuffle_read_bytes": None,
                "spark_result_bytes": None,
                "spark_failed_tasks": None,
                "spark_stages": None,
            }
        return {
            "spark_shuffle_bytes": self.shuffle_write,
            "spark_shuffle_read_bytes": self.shuffle_read,
            "spark_result_bytes": self.result_bytes,
            "spark_failed_tasks": self.failed_tasks,
            "spark_stages": self.stages,
        }
