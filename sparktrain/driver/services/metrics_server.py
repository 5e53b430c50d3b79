"""Progress and metrics, the driver's end: the server rank 0 reports to, and the display.

Every rank also streams its printed lines and its failure report here
(:mod:`sparktrain.task.output`), handed to ``on_output`` with the rank its handshake
proved (:mod:`sparktrain.driver.services.task_output`).

Rank 0 (:mod:`sparktrain.task.metrics_client`) sends JSON messages (``start``,
``step``, ``epoch``; ``report`` under ``sparktrain.run``) over the same wire as the
allreduce (``KIND_METRICS`` frames, never pickle). The driver's :class:`MetricsServer`
reads them; its :class:`ProgressDisplay` shows a live progress bar, appends one JSON line
per epoch or report to ``metrics_jsonl`` and hands the run's events to its listeners
(callbacks, TensorBoard, MLflow: :mod:`sparktrain.driver.services.loggers`). Progress is a
convenience: if the channel breaks, training goes on and a warning is logged.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sparktrain.driver.services.loggers import ListenerGroup, RunListener, figures
from sparktrain.errors import CommError

# The client's names, for the old path sparktrain.metrics only (sparktrain/_moved.py):
# they go with its row in the next release. Import them from sparktrain.task.metrics_client.
from sparktrain.task.metrics_client import (  # noqa: F401
    STEP_REPORT_INTERVAL_S,
    MetricsClient,
    start_reporter,
)
from sparktrain.task.output import MESSAGE_TYPES as OUTPUT_MESSAGES
from sparktrain.wire.connection import Connection
from sparktrain.wire.frames import KIND_METRICS
from sparktrain.wire.security import WireSecurity
from sparktrain.wire.service import DriverService

if TYPE_CHECKING:
    from torch import nn

log = logging.getLogger(__name__)

# MetricsServer.stop: how long the readers may go on working through what rank 0 sent
# before it closed its end (a slow listener: each record goes to the listeners before the
# next is read), and how long a reader may wait for more before its client counts as alive
# but silent (nothing left to drain).
DRAIN_LIMIT_S = 60.0
DRAIN_IDLE_S = 0.5


class MetricsServer(DriverService):
    """The driver's end: accepts rank 0 (of any attempt), feeds a progress display.

    Each client is read on its own thread, which hands every message to ``on_message``
    before it reads the next: a slow listener leaves messages waiting in the socket.
    :meth:`stop` lets those be delivered first (see there)."""

    name = "metrics"

    def __init__(
        self,
        host: str,
        *,
        secret: bytes,
        job_id: str,
        attempt: int,
        on_message: Callable[[dict[str, Any]], None],
        idle_timeout: float = 24 * 3600.0,
        security: WireSecurity | None = None,
        on_output: Callable[[int, dict[str, Any]], None] | None = None,
    ) -> None:
        super().__init__(host, secret=secret, job_id=job_id, attempt=attempt, security=security)
        self._on_message = on_message
        # every rank's output and failure reports (sparktrain.task.output), with the rank
        # its handshake proved (driver/services/task_output.py); None: ignored
        self._on_output = on_output
        self._idle_timeout = idle_timeout
        self._conns: list[Connection] = []
        self._lock = threading.Lock()
        # per reading client: since when it waits for a message (None: handling one)
        self._waiting: dict[int, float | None] = {}
        self.start()

    def handle(self, conn: Connection) -> None:
        with self._lock:
            if self.stopping:  # stop() ran between the accept and here
                conn.close()
                return
            self._conns.append(conn)
            self._waiting[id(conn)] = time.monotonic()
        conn.set_timeout(self._idle_timeout)
        try:
            while not self.stopping:
                try:
                    _, payload = conn.recv_bytes(KIND_METRICS, max_bytes=1 << 20)
                    message = json.loads(payload)
                except (CommError, OSError, ValueError):
                    return
                with self._lock:
                    self._waiting[id(conn)] = None
                if isinstance(message, dict) and message.get("type") in OUTPUT_MESSAGES:
                    if self._on_output is not None:
                        try:
                            self._on_output(conn.peer_rank, message)
                        except Exception:  # a sink bug must not end the reader
                            log.exception("task output sink failed")
                elif isinstance(message, dict):
                    try:
                        self._on_message(message)
                    except Exception:  # a display bug must not end the reader
                        log.exception("metrics display failed")
                with self._lock:
                    self._waiting[id(conn)] = time.monotonic()
        finally:
            with self._lock:
                self._waiting.pop(id(conn), None)

    def stop(self) -> None:
        """Deliver what the clients sent, then close the listener and every connection;
        idempotent.

        Rank 0 closes its end when its task ends, but a slow listener may not have seen
        its last records yet: they wait in the socket. So the readers first go on until
        each has reached its client's end, or has waited :data:`DRAIN_IDLE_S` for more
        (a client still connected but silent, e.g. a failed stage's), or
        :data:`DRAIN_LIMIT_S` passed; the records left then are dropped with a warning."""
        deadline = time.monotonic() + DRAIN_LIMIT_S
        while not self.stopping:
            with self._lock:
                now = time.monotonic()
                busy = [s for s in self._waiting.values() if s is None or now - s < DRAIN_IDLE_S]
            if not busy:
                break
            if now >= deadline:
                log.warning(
                    "the run's listeners took over %.0f s for its last records; the rest "
                    "are dropped",
                    DRAIN_LIMIT_S,
                )
                break
            time.sleep(0.02)
        self._stopping.set()
        with self._lock:
            for conn in self._conns:
                conn.close()
            self._conns.clear()
        super().stop()


class ProgressDisplay:
    """A tqdm bar (epoch, step, loss, samples/s) on a terminal, a log line per epoch or
    report, per-record JSON lines in ``jsonl_path``, and the run's events for
    ``listeners`` (:mod:`sparktrain.driver.services.loggers`; ``config``, the run's config
    dict, goes to their ``on_start``).

    ``epochs`` holds every epoch record received (a redone epoch twice); ``history``, what
    listeners get, holds the run's epoch and report records as one run: when a
    resubmitted stage reports an epoch again, the failed attempt's records from that
    epoch on are dropped from it first. Call :meth:`finish` or :meth:`fail` once the fit
    ended."""

    def __init__(
        self,
        enabled: bool,
        jsonl_path: str = "",
        listeners: Sequence[RunListener] = (),
        *,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        self.enabled = enabled
        self.jsonl_path = jsonl_path
        self.epochs: list[dict[str, Any]] = []
        self.history: list[dict[str, Any]] = []
        self._listeners = ListenerGroup(listeners, config)
        self._rewind = False  # a resubmitted stage started: its first record rewinds history
        self._bar: Any = None
        self._steps_per_epoch = 0
        self.last_global_step = 0  # as far as rank 0 reported (steps are throttled)
        self._lock = threading.Lock()

    def __call__(self, message: dict[str, Any]) -> None:
        with self._lock:
            kind = message.get("type")
            if kind == "start":
                self._start(message)
            elif kind == "step":
                done = int(message["epoch"]) * self._steps_per_epoch + int(message["step"])
                self.last_global_step = max(self.last_global_step, done)
                if self._bar is None:
                    return
                self._advance(done)
                self._bar.set_postfix(
                    epoch=message["epoch"] + 1,
                    loss=f"{message['loss']:.4f}",
                    samples_s=f"{message['samples_per_s']:.0f}",
                    refresh=False,
                )
            elif kind == "epoch":
                self._epoch(message)
            elif kind == "report":
                self._record(message)

    def live_bar(self) -> Any:
        """The tqdm bar on screen now, or None: the tasks' printed lines go above it."""
        return self._bar

    def _start(self, message: dict[str, Any]) -> None:
        self._steps_per_epoch = int(message.get("steps_per_epoch", 0))
        if self._bar is not None:  # a resubmitted stage starts a fresh bar
            self._bar.close()
            self._bar = None
        if self.enabled:
            from tqdm.auto import tqdm

            total = int(message.get("epochs", 0)) * self._steps_per_epoch
            # disable=None: a bar on a terminal only, never \r-garbage in CI logs
            self._bar = tqdm(total=total, unit="step", desc="training", disable=None)
        self._rewind = self._listeners.started  # every attempt sends a start
        self._listeners.start(message)

    def _epoch(self, message: dict[str, Any]) -> None:
        self.epochs.append(message)
        self.last_global_step = max(
            self.last_global_step, (int(message["epoch"]) + 1) * self._steps_per_epoch
        )
        if self._bar is not None and not self._bar.disable:
            self._advance((int(message["epoch"]) + 1) * self._steps_per_epoch)
        self._record(message)

    def _record(self, message: dict[str, Any]) -> None:
        """An epoch or report record: the JSON line, the log line, the listeners."""
        if self.jsonl_path:
            path = Path(self.jsonl_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a") as fh:
                fh.write(json.dumps(message) + "\n")
        line = record_line(message)
        if self._bar is not None and not self._bar.disable:
            self._bar.write(line)
        elif self.enabled:
            log.info(line)
        if self._rewind and "epoch" in message:
            self.history = [h for h in self.history if h.get("epoch", -1) < message["epoch"]]
        self._rewind = False
        self.history.append(message)
        self._listeners.record(message, self.history)

    def replay(self, history: Sequence[Mapping[str, Any]]) -> None:
        """Records that never came live (the tasks could not reach the driver): the
        JSON lines, log lines and listeners get them now, once each."""
        with self._lock:
            if self.history or not history:
                return
            if not self._listeners.started:
                self._listeners.start({"type": "start", "replayed": True})
            for record in history:
                self._record({"type": record.get("type", "report"), **record})

    def finish(self, summary: dict[str, Any], model: nn.Module | None) -> None:
        """The fit succeeded: listeners' ``on_finish`` (MLflow uploads the model here)."""
        with self._lock:
            self._listeners.finish(summary, model)

    def fail(self, error: BaseException) -> None:
        """The fit raised ``error``: listeners' ``on_error`` (an MLflow run ends FAILED)."""
        with self._lock:
            self._listeners.error(error)

    def history_before(self, step: int) -> tuple[dict[str, Any], ...]:
        """Epoch records of the epochs completed by global ``step`` (the latest report of
        each epoch, whatever attempt sent it)."""
        if self._steps_per_epoch <= 0:
            return ()
        done = step // self._steps_per_epoch
        latest = {int(m["epoch"]): m for m in self.epochs}
        return tuple(latest[e] for e in range(done) if e in latest)

    def _advance(self, done: int) -> None:
        self._bar.update(max(0, done - self._bar.n))

    def close(self) -> None:
        with self._lock:
            if self._bar is not None:
                self._bar.close()
                self._bar = None


def record_line(record: dict[str, Any]) -> str:
    """The log line of an epoch or report record (epochs counted from 1).

    An epoch record with a ``metric_name``: ``epoch 3: loss 0.2345 accuracy 0.9123
    (1.20 s)`` (further figures before the time); any other: every figure in order,
    ``epoch 3: val_auc 0.9123 loss 0.2345``."""
    head = f"epoch {int(record.get('epoch', 0)) + 1}:"
    values = figures(record)
    if "metric_name" in record and {"loss", "metric", "seconds"} <= record.keys():
        name = record["metric_name"]
        extra = {k: v for k, v in values.items() if k not in ("loss", name, "seconds")}
        parts = [f"loss {record['loss']:.4f}", f"{name} {record['metric']:.4f}"]
        parts += [f"{k} {_number(v)}" for k, v in extra.items()]
        return f"{head} {' '.join(parts)} ({record['seconds']:.2f} s)"
    return " ".join([head, *(f"{k} {_number(v)}" for k, v in values.items())])


def _number(value: int | float) -> str:
    return str(value) if isinstance(value, int) else f"{value:.4f}"
