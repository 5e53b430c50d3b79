"""Checks the driver makes before launching a barrier stage, so that a job that cannot be
gang-scheduled fails at once with a clear message instead of Spark's 10-minute retry."""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING

from sparktrain.errors import ResourceError

if TYPE_CHECKING:
    from pyspark import SparkContext

_LOCAL = re.compile(r"^local(\[(\*|\d+)(,\s*\d+)?\])?$")


def task_cpus(sc: SparkContext) -> int:
    return int(sc.getConf().get("spark.task.cpus", "1"))


def max_concurrent_tasks(sc: SparkContext) -> int:
    """Task slots Spark can run at once right now (what barrier scheduling needs)."""
    jsc = sc._jsc.sc()
    profile = jsc.resourceProfileManager().resourceProfileFromId(0)
    return int(jsc.maxNumConcurrentTasks(profile))


def check_can_launch(
    sc: SparkContext, num_workers: int, wait_for_executors_s: float = 60.0
) -> None:
    """Refuse dynamic allocation, and wait (bounded) for enough free task slots."""
    conf = sc.getConf()
    if conf.get("spark.dynamicAllocation.enabled", "false").lower() == "true":
        raise ResourceError(
            "barrier-mode training cannot run with dynamic allocation: set "
            "spark.dynamicAllocation.enabled=false for this application "
            "(or use strategy='tree_aggregate', which needs no gang scheduling)"
        )
    master = str(sc.master)
    # In local mode the slots are known at once; on a cluster executors may still register.
    deadline = time.monotonic() + (0.0 if _LOCAL.match(master) else wait_for_executors_s)
    while True:
        slots = max_concurrent_tasks(sc)
        if slots >= num_workers:
            return
        if time.monotonic() >= deadline:
            raise ResourceError(
                f"num_workers={num_workers} needs {num_workers} task slots at once, but "
                f"{master} offers {slots} (spark.task.cpus={task_cpus(sc)}); lower num_workers "
                "or give the application more executor cores"
            )
        time.sleep(0.5)
