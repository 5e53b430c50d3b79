"""No barrier stage outlives the call that launched it, and none waits forever for a slot
something left behind holds (local[2]: a 2-task barrier stage needs both slots).

Spark kills the other tasks of a failed barrier stage some seconds after the job has
failed (a Python task's worker goes after ``spark.python.task.killTimeout``): the driver
already raised, and a task of the dead stage still held its slot. A barrier stage asking
for every slot then waited for it without a word (Spark checks the slots a barrier stage
needs at submission against the application's slots, not the free ones).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import pytest

import sparktrain
from sparktrain import TrainConfig
from sparktrain.driver import occupancy
from sparktrain.errors import ResourceError, SparkTrainError

pytestmark = pytest.mark.timeout(180, func_only=True)


def rank_1_fails_rank_0_sleeps(ctx: Any) -> None:
    if ctx.rank == 1:
        raise ValueError("rank one gives up")
    time.sleep(300)  # killed with its stage, long after the driver has its error


def cfg() -> TrainConfig:
    return TrainConfig(progress=False, comm_timeout=30.0, max_restarts=0)


def test_a_failed_stage_has_stopped_every_task_when_run_raises(spark):  # type: ignore[no-untyped-def]
    sc = spark.sparkContext
    with pytest.raises(SparkTrainError, match="rank one gives up"):
        sparktrain.run(rank_1_fails_rank_0_sleeps, num_workers=2, config=cfg(), spark=spark)
    # right away: the sleeping rank's task has stopped, its slot is free again
    assert occupancy.running_tasks(sc) == 0
    assert sc.statusTracker().getActiveJobsIds() == []


def rank(ctx: Any) -> int:
    return int(ctx.rank)


def sleeps(_: Any) -> Any:
    time.sleep(300)
    return 0


@pytest.fixture()
def leftover_job(spark):  # type: ignore[no-untyped-def]
    """A one-task job of a sparktrain job group whose launcher is gone, holding one of
    local[2]'s two slots until cancelled."""
    sc = spark.sparkContext
    group = "sparktrain-leftover-0"

    def submit() -> None:
        sc.setJobGroup(group, "a training stage nobody waits for", True)
        with contextlib.suppress(Exception):  # cancelled below
            sc.parallelize([0], 1).map(sleeps).collect()

    thread = threading.Thread(target=submit, daemon=True)
    thread.start()
    for _ in range(600):  # its task runs within seconds
        if occupancy.running_tasks(sc) >= 1:
            break
        time.sleep(0.1)
    try:
        yield group
    finally:
        sc.cancelJobGroup(group)
        thread.join(timeout=60)


def test_a_stage_whose_slot_is_held_by_a_leftover_fails_naming_it(spark, leftover_job, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setattr(occupancy, "LEFTOVER_WAIT_S", 2.0)
    with pytest.raises(ResourceError, match=f"2 free task slots.*{leftover_job}"):
        sparktrain.run(rank, num_workers=2, config=cfg(), spark=spark)
