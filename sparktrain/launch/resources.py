"""Checks the driver makes before launching a barrier stage, so that a job that cannot be
gang-scheduled fails at once with a clear message instead of Spark's 10-minute retry."""

from __future__ import annotations

import logging
import re
import threading
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
    # In local mode the slots are known at once; on a cluster executors may still register.
    deadline = time.monotonic() + (0.0 if is_local(sc) else wait_for_executors_s)
    while True:
        slots = max_concurrent_tasks(sc)
        if slots >= num_workers:
            return
        if time.monotonic() >= deadline:
            raise ResourceError(too_few_slots(sc, num_workers, slots))
        time.sleep(0.5)


def too_few_slots(sc: SparkContext, num_workers: int, slots: int) -> str:
    """The message for a barrier stage that cannot be gang-scheduled."""
    return (
        f"num_workers={num_workers} needs {num_workers} task slots at once, but "
        f"{sc.master} offers {slots} (spark.task.cpus={task_cpus(sc)}); lower num_workers "
        "or give the application more executor cores"
    )


def is_local(sc: SparkContext) -> bool:
    """``local``/``local[N]``: the slots never change while the application runs."""
    return bool(_LOCAL.match(str(sc.master)))


class SlotWatchdog:
    """Watches the task slots while a barrier stage is submitted.

    Spark checks a barrier stage's slots once, when its job is submitted. If executors
    are lost after that but before all of the stage's tasks started, the stage waits for
    free slots that never come: a hang (seen on the standalone cluster when a worker
    died while the stage waited for its data). When fewer than ``num_workers`` slots
    remain for ``grace_s`` seconds, the watchdog cancels the job group and keeps
    :attr:`reason`, so the caller can raise :class:`ResourceError` instead. A running
    stage that loses an executor fails by itself first; the grace period lets a lost
    executor be replaced.
    """

    def __init__(
        self,
        sc: SparkContext,
        num_workers: int,
        group: str,
        grace_s: float = 15.0,
        poll_s: float = 1.0,
    ) -> None:
        self.sc, self.num_workers, self.group = sc, num_workers, group
        self.grace_s, self.poll_s = grace_s, poll_s
        self.reason: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sparktrain-slots", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        short_since: float | None = None
        while not self._stop.wait(self.poll_s):
            try:
                slots = max_concurrent_tasks(self.sc)
            except Exception:  # the context is stopping: nothing to watch
                return
            if slots >= self.num_workers:
                short_since = None
                continue
            now = time.monotonic()
            short_since = now if short_since is None else short_since
            if now - short_since >= self.grace_s:
                self.reason = too_few_slots(self.sc, self.num_workers, slots)
                log.warning("%s: cancelling the training stage", self.reason)
                try:
                    self.sc.cancelJobGroup(self.group)
                except Exception as exc:
                    log.warning("could not cancel the training stage: %s", exc)
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
