"""Who holds the application's task slots right now, and waiting (bounded) until a job
group's tasks are gone.

Spark checks a barrier stage's slots once, at submission, against the slots the
application *has*, not the ones that are free: a task still running from an earlier job
(a cancelled stage whose task has not ended yet, a job another thread left running)
holds a slot, and a barrier stage needing every slot then waits for it with nothing
said. These helpers read Spark's own status store (the listener's view, which a task
joins when it starts and leaves when it really ends, killed or not) through a classic
session's SparkContext; under Spark Connect the client cannot see tasks, and each
helper says so by returning ``None``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sparktrain.errors import ResourceError

if TYPE_CHECKING:
    from pyspark import SparkContext

    from sparktrain.driver.spark_env import SparkEnv

log = logging.getLogger(__name__)

GROUP_PREFIX = "sparktrain-"
"""Every job group sparktrain's launchers set starts with this (``driver/stage_runner.py``)."""


@dataclass(frozen=True)
class ActiveJob:
    """A job Spark still runs: what the UI would show for it."""

    job_id: int
    group: str | None
    description: str
    stage_ids: tuple[int, ...]
    active_tasks: int

    @property
    def ours(self) -> bool:
        """Was it submitted by one of sparktrain's launchers (its job group says so)?"""
        return (self.group or "").startswith(GROUP_PREFIX)

    def __str__(self) -> str:
        group = f" group {self.group!r}" if self.group else ""
        return (
            f"job {self.job_id}{group} ({self.description or 'no description'}; stages "
            f"{list(self.stage_ids)}, {self.active_tasks} running tasks)"
        )


def context_of(env: SparkEnv) -> SparkContext | None:
    """The classic SparkContext behind ``env`` (None under Spark Connect)."""
    sc = getattr(env, "sc", None)
    return None if env.connect else sc


def _option(value: Any) -> str | None:
    """A Scala ``Option[String]`` through Py4J."""
    return str(value.get()) if value is not None and value.isDefined() else None


def active_jobs(sc: SparkContext) -> list[ActiveJob]:
    """The application's running jobs, with their job group and description."""
    store = sc._jsc.sc().statusStore()
    jobs = []
    for job_id in sorted(sc.statusTracker().getActiveJobsIds()):
        try:
            data = store.job(job_id)
        except Exception:  # ended between the two calls
            continue
        stages = data.stageIds()
        jobs.append(
            ActiveJob(
                job_id=job_id,
                group=_option(data.jobGroup()),
                description=_option(data.description()) or str(data.name()),
                stage_ids=tuple(int(stages.apply(i)) for i in range(stages.size())),
                active_tasks=int(data.numActiveTasks()),
            )
        )
    return jobs


def running_tasks(sc: SparkContext) -> int:
    """Tasks running on the application's executors (the driver's in local mode), of
    any job, ended or not: a killed task counts until it has really stopped."""
    infos = sc._jsc.sc().statusTracker().getExecutorInfos()
    return sum(int(info.numRunningTasks()) for info in infos)


def group_tasks(sc: SparkContext, group: str) -> int:
    """Tasks still running in the stages of job group ``group``'s jobs, finished jobs
    included (a failed or cancelled stage's tasks stop some seconds after it)."""
    tracker = sc.statusTracker()
    stages: set[int] = set()
    for job_id in tracker.getJobIdsForGroup(group):
        info = tracker.getJobInfo(job_id)
        if info is not None:
            stages.update(info.stageIds)
    count = 0
    for stage_id in stages:
        stage = tracker.getStageInfo(stage_id)
        if stage is not None:
            count += stage.numActiveTasks
    return count


def describe(jobs: list[ActiveJob], running: int) -> str:
    """What holds the slots, for an error message."""
    held = sum(j.active_tasks for j in jobs)
    parts = [str(j) for j in jobs]
    if running > held:  # tasks of jobs that already ended (killed, still stopping)
        parts.append(f"{running - held} task(s) of jobs that already ended, still stopping")
    return "; ".join(parts) or "nothing Spark reports"


def wait_until_stopped(env: SparkEnv, group: str, timeout_s: float = 30.0) -> bool:
    """Wait (at most ``timeout_s``) until no task of ``group`` runs any more; True when
    none does (or, under Spark Connect, when the client cannot tell)."""
    sc = context_of(env)
    if sc is None:
        return True
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            left = group_tasks(sc, group)
        except Exception:  # the context is stopping: nothing left to wait for
            return True
        if left == 0:
            return True
        if time.monotonic() >= deadline:
            log.warning(
                "job group %s was cancelled but %d of its tasks still run after %.0f s",
                group,
                left,
                timeout_s,
            )
            return False
        time.sleep(0.2)


LEFTOVER_WAIT_S = 30.0
"""How long a barrier stage waits for slots held by work left over from an earlier job
(a killed Python task stops within seconds: ``spark.python.task.killTimeout``)."""

_live: set[str] = set()  # job groups whose launcher is still inside launching()


@contextlib.contextmanager
def launching(env: SparkEnv, group: str, timeout_s: float | None = None) -> Iterator[None]:
    """The block that runs job group ``group``'s stage: on any way out but success
    (an error, KeyboardInterrupt, a timeout) the group is cancelled and its tasks are
    waited for (at most ``timeout_s``), so no task of it outlives the call and holds a
    slot the next barrier stage needs. While the block runs, the group counts as a
    live job of this process for :func:`wait_for_free_slots`."""
    _live.add(group)
    try:
        yield
    except BaseException:
        try:
            env.cancel_group(group)
        except Exception as exc:  # the context is stopping: nothing left to cancel
            log.debug("could not cancel job group %s: %s", group, exc)
        wait_until_stopped(env, group, LEFTOVER_WAIT_S if timeout_s is None else timeout_s)
        raise
    finally:
        _live.discard(group)


def wait_for_free_slots(env: SparkEnv, num_workers: int, timeout_s: float | None = None) -> None:
    """Before a barrier stage: wait (at most ``timeout_s``) until ``num_workers`` slots
    are free, when what holds them is left over from sparktrain (a job whose launcher
    has returned, or tasks of a job that already ended); then raise
    :class:`~sparktrain.errors.ResourceError` naming it. Slots held by a job that is
    still someone's business (a user's job, a fit running in another thread) end on
    their own: the stage queues behind them as Spark schedules it."""
    sc = context_of(env)
    slots = env.slots()
    if sc is None or slots is None or slots < num_workers:  # check_can_launch's business
        return
    timeout_s = LEFTOVER_WAIT_S if timeout_s is None else timeout_s
    deadline = time.monotonic() + timeout_s
    said = False
    while True:
        running = running_tasks(sc)
        if slots - running >= num_workers:
            return
        jobs = active_jobs(sc)
        if any(j.active_tasks and (not j.ours or j.group in _live) for j in jobs):
            log.info("the training stage waits for running jobs: %s", describe(jobs, running))
            return
        if time.monotonic() >= deadline:
            raise ResourceError(
                f"num_workers={num_workers} needs {num_workers} free task slots of "
                f"{slots}, but after {timeout_s:.0f} s work left over from an earlier job "
                f"still holds {running}: {describe(jobs, running)}. Cancel it "
                "(SparkContext.cancelJobGroup / cancelAllJobs) or wait for it to end; "
                "the barrier stage would otherwise wait for those slots without end"
            )
        if not said:
            log.info(
                "waiting up to %.0f s for slots held by earlier work: %s",
                timeout_s,
                describe(jobs, running),
            )
            said = True
        time.sleep(0.2)
