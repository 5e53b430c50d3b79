"""A quiet console: what Spark prints on the driver's terminal while sparktrain works.

- :func:`quiet_stage`: while a sparktrain stage runs, the failures it handles (a task
  that raised a sparktrain error, a killed worker that the stage runner resubmits, a
  task Spark retries) print no JVM stack traces: the loggers that print one per failed
  task (``Executor``'s "Exception in task", ``TaskSetManager``'s "Lost task") are
  switched off for the stage and restored after it, and sparktrain says in one line what
  happened (the Spark error text goes to sparktrain's DEBUG log,
  :meth:`sparktrain.errors.WorkerError.from_spark`). Spark's console progress bar
  (``spark.ui.showConsoleProgress``, on in a plain ``SparkSession``) is held back for
  the stage too, so it does not draw over sparktrain's own progress display.
- :func:`submitted_driver_conf`: under ``spark-submit`` the driver JVM starts before
  Python runs, so ``spark.driver.extraJavaOptions`` cannot point it at sparktrain's
  log4j2 file, and log4j runs on Spark's default profile (INFO: ~42 lines while the
  SparkContext starts); ``spark.log.level=WARN`` keeps all but three of them away.
  (Reconfiguring log4j from Python before the SparkContext starts does not last: Spark
  loads its default profile again when the context starts.)

Everything here goes through the driver JVM's log4j2 and Spark's progress bar by Py4J;
if either is not what it expects (another logging backend, another Spark), it does
nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark import SparkContext

log = logging.getLogger(__name__)

# The driver's loggers that print one stack trace per failed task.
TASK_FAILURE_LOGGERS = (
    "org.apache.spark.executor.Executor",
    "org.apache.spark.scheduler.TaskSetManager",
)
# How often the held-back progress bar is reset: it draws a stage only once it has run
# 500 ms and 500 ms have passed since its last reset (ConsoleProgressBar.firstDelayMSec).
BAR_HOLD_S = 0.2
# After a failed stage, the longest wait for its other tasks to end (their "Lost task"
# lines come after the job already failed) before the loggers are restored.
SETTLE_S = 10.0

_lock = threading.Lock()
_depth: dict[int, int] = {}  # id(SparkContext) -> stages running quietly
_saved: dict[int, list[tuple[str, Any]]] = {}  # id(SparkContext) -> (logger, level or None)
_holders: dict[int, threading.Event] = {}  # id(SparkContext) -> stops the bar holder


def submitted_driver_conf() -> dict[str, str]:
    """Under ``spark-submit`` (a driver JVM already running, no SparkContext yet), the
    setting that keeps the SparkContext's start quiet: ``spark.log.level=WARN``, which
    Spark applies before most of its start-up INFO lines (what
    :func:`~sparktrain.session.get_or_create_session` does anyway once the session is
    up). Empty when not under spark-submit or when the user set ``spark.log.level``."""
    if "PYSPARK_GATEWAY_PORT" not in os.environ or os.environ.get("SPARK_REMOTE"):
        return {}
    from pyspark import SparkContext

    try:
        SparkContext._ensure_initialized()  # attaches to spark-submit's JVM, starts nothing
        jvm = SparkContext._jvm
        assert jvm is not None
        if jvm.java.lang.System.getProperty("spark.log.level") is not None:
            return {}  # spark-submit --conf spark.log.level=...: the user's choice
    except Exception as exc:
        log.debug("could not read spark-submit's settings: %s", exc)
        return {}
    return {"spark.log.level": "WARN"}


@contextlib.contextmanager
def quiet_stage(sc: SparkContext, group: str | None = None) -> Iterator[None]:
    """Inside the block (a sparktrain stage), the per-task failure loggers are off and
    Spark's console progress bar is held back; afterwards (once the stage's remaining
    tasks of job group ``group`` ended, at most ``SETTLE_S``) both come back as they
    were. Stages may overlap (threads): the first to enter quiets, the last to leave
    restores."""
    key = id(sc)
    with _lock:
        first = _depth.get(key, 0) == 0
        _depth[key] = _depth.get(key, 0) + 1
        if first:
            _saved[key] = _silence(sc)
            _holders[key] = _hold_progress_bar(sc)
    try:
        yield
    finally:
        if group is not None:
            _settle(sc, group)
        with _lock:
            _depth[key] -= 1
            if _depth[key] == 0:
                del _depth[key]
                _restore(sc, _saved.pop(key, []))
                _holders.pop(key).set()


@contextlib.contextmanager
def progress_bar_held(sc: SparkContext) -> Iterator[None]:
    """Spark's console progress bar held back inside the block only (a fit's data
    preparation: its jobs are sparktrain's, their failures are the user's to see)."""
    stop = _hold_progress_bar(sc)
    try:
        yield
    finally:
        stop.set()


def _log4j(sc: SparkContext) -> tuple[Any, Any]:
    """The driver JVM's log4j2 core LoggerContext and Level class."""
    jvm = sc._jvm
    assert jvm is not None
    log4j = jvm.org.apache.logging.log4j
    return log4j.LogManager.getContext(False), log4j.Level


def _silence(sc: SparkContext) -> list[tuple[str, Any]]:
    """Switch the task-failure loggers off; returns each one's own configured level
    (None: it had no configuration of its own and inherited its parent's)."""
    saved: list[tuple[str, Any]] = []
    try:
        context, level = _log4j(sc)
        config = context.getConfiguration()
        for name in TASK_FAILURE_LOGGERS:
            own = config.getLoggerConfig(name)
            saved.append((name, own.getLevel() if own.getName() == name else None))
            configurator = sc._jvm.org.apache.logging.log4j.core.config.Configurator  # type: ignore[union-attr]
            configurator.setLevel(name, level.OFF)
    except Exception as exc:  # not log4j2-core: Spark prints as it always does
        log.debug("could not quiet Spark's task-failure loggers: %s", exc)
    return saved


def _restore(sc: SparkContext, saved: list[tuple[str, Any]]) -> None:
    if not saved:
        return
    try:
        context, _ = _log4j(sc)
        config = context.getConfiguration()
        for name, level in saved:
            if level is None:
                config.removeLogger(name)  # back to inheriting its parent's level
            else:
                config.getLoggerConfig(name).setLevel(level)
        context.updateLoggers()
    except Exception as exc:
        log.debug("could not restore Spark's task-failure loggers: %s", exc)


def _hold_progress_bar(sc: SparkContext) -> threading.Event:
    """Keep Spark's console progress bar (if the session shows one) from drawing until
    the returned event is set: a daemon thread resets it every ``BAR_HOLD_S``, which
    clears what it drew and starts its 500 ms delay again (``finishAll``, what Spark
    itself calls when a job ends)."""
    stop = threading.Event()
    try:
        bar_option = sc._jsc.sc().progressBar()
        if bar_option.isEmpty():
            return stop
        bar = bar_option.get()
    except Exception as exc:
        log.debug("no console progress bar to hold back: %s", exc)
        return stop

    def hold() -> None:
        while not stop.is_set():
            try:
                bar.finishAll()
            except Exception:  # the context stopped
                return
            stop.wait(BAR_HOLD_S)

    threading.Thread(target=hold, name="sparktrain-progress-bar", daemon=True).start()
    return stop


def _settle(sc: SparkContext, group: str) -> None:
    """Wait (at most ``SETTLE_S``) until no task of ``group``'s jobs runs any more: a
    failed barrier stage's other tasks are killed after the job already failed, and
    their "Lost task" lines must not come after the loggers are back."""
    try:
        tracker = sc.statusTracker()
        stages = [
            stage
            for job_id in tracker.getJobIdsForGroup(group)
            for stage in (getattr(tracker.getJobInfo(job_id), "stageIds", None) or ())
        ]
        stop = threading.Event()
        for _ in range(int(SETTLE_S / 0.05)):
            infos = [tracker.getStageInfo(s) for s in stages]
            if all(i is None or i.numActiveTasks == 0 for i in infos):
                return
            stop.wait(0.05)
    except Exception as exc:
        log.debug("could not wait for the stage's tasks to end: %s", exc)
