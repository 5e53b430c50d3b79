"""Progress and metrics, the executor's end: rank 0's half of the channel to the driver.

Rank 0 sends JSON messages (``start``, ``step``, ``epoch``; ``report`` under
``sparktrain.run``) over the same wire as the allreduce (``KIND_METRICS`` frames, never
pickle) to the driver's :class:`~sparktrain.driver.services.metrics_server.MetricsServer`, which
shows them and hands them to the run's listeners. Progress is a convenience: if the
channel breaks, training goes on and a warning is logged. Nothing here imports pyspark.
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Any

from sparktrain.errors import CommError
from sparktrain.wire.connection import Connection
from sparktrain.wire.frames import KIND_METRICS
from sparktrain.wire.handshake import DRIVER_RANK, connect
from sparktrain.wire.security import WireSecurity
from sparktrain.wire.stats import CommStats

if TYPE_CHECKING:
    from sparktrain.task.context import JobSpec

log = logging.getLogger(__name__)

# Step messages are throttled so that progress never costs training time (tree_aggregate's
# driver, which feeds its display itself, throttles its own step records the same way).
STEP_REPORT_INTERVAL_S = 0.25


class MetricsClient:
    """Rank 0's end of the channel; every method swallows communication failures."""

    def __init__(
        self,
        address: str,
        *,
        secret: bytes,
        job_id: str,
        attempt: int,
        timeout: float,
        security: WireSecurity | None = None,
    ) -> None:
        self._conn: Connection | None = None
        self._last_step = 0.0
        try:
            self._conn = connect(
                address,
                secret=secret,
                job_id=job_id,
                attempt=attempt,
                my_rank=0,
                peer_rank=DRIVER_RANK,
                timeout=timeout,
                stats=CommStats(),
                security=security,
            )
        except (CommError, OSError) as exc:
            log.warning("progress channel to the driver unavailable (%s); training goes on", exc)

    def step_due(self) -> bool:
        """True at most every STEP_REPORT_INTERVAL_S: ask before building a step message."""
        if self._conn is None:
            return False
        now = time.monotonic()
        if now - self._last_step < STEP_REPORT_INTERVAL_S:
            return False
        self._last_step = now
        return True

    def send(self, message: dict[str, Any]) -> None:
        if self._conn is None:
            return
        try:
            self._conn.send_bytes(json.dumps(message).encode(), KIND_METRICS)
        except (CommError, OSError) as exc:
            log.warning("progress channel to the driver broke (%s); training goes on", exc)
            self.close()

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def start_reporter(
    spec: JobSpec, *, steps_per_epoch: int, world_size: int, train_samples: int
) -> MetricsClient | None:
    """The reporting rank's channel to the driver, opened with the ``start`` message
    (None when the job has no metrics channel, e.g. a thread harness)."""
    if not spec.metrics_address:
        return None
    reporter = MetricsClient(
        spec.metrics_address,
        secret=spec.secret,
        job_id=spec.job_id,
        attempt=spec.attempt,
        timeout=min(spec.config.comm_timeout, 10.0),
        security=spec.security,
    )
    reporter.send(
        {
            "type": "start",
            "epochs": spec.config.epochs,
            "steps_per_epoch": steps_per_epoch,
            "world_size": world_size,
            "train_samples": train_samples,
        }
    )
    return reporter
