"""Checks the driver makes before launching a barrier stage, so that a job that cannot be
gang-scheduled fails at once with a clear message instead of Spark's 10-minute retry."""

from __future__ import annotations

import logging
import re
import time
from typing import TYPE_CHECKING

from sparktrain.errors import ResourceError

if TYPE_CHECKING:
    from pyspark import SparkContext

log = logging.getLogger(__name__)

_LOCAL = re.compile(r"^local(\[(\*|\d+)(,\s*\d+)?\])?$")


def task_cpus(sc: SparkContext) -> int:
    return int(sc.getConf().get("spark.task.cpus", "1"))


def max_concurrent_tasks(sc: SparkContext) -> int:
    """Task slots Spark can run at once right now (what barrier scheduling needs)."""
    jsc = sc._jsc.sc()
    profile = jsc.resourceProfileManager().resourceProfileFromId(0)
    return int(jsc.maxNumConcurrentTasks(profile))


_ENCRYPTION_KEYS = (
    "spark.network.crypto.enabled",
    "spark.ssl.enabled",
    "spark.io.encryption.enabled",
)


def check_transport_security(sc: SparkContext, allow_unencrypted: bool) -> None:
    """Refuse to move gradients in plaintext when the user asked Spark to encrypt."""
    conf = sc.getConf()
    enabled = [k for k in _ENCRYPTION_KEYS if str(conf.get(k, "false")).lower() == "true"]
    if enabled and not allow_unencrypted:
        raise ResourceError(
            f"Spark encrypts its traffic here ({', '.join(enabled)}=true), but sparktrain's "
            "gradient sockets are authenticated, not encrypted. Set allow_unencrypted=true to "
            "accept that, or use strategy='tree_aggregate', which moves everything through "
            "Spark's own (encrypted) transport"
        )
    if enabled:
        log.warning(
            "Spark encryption is on but sparktrain's sockets are not encrypted "
            "(allow_unencrypted=true)"
        )


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
