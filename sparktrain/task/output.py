"""What the user's code prints in a task, streamed to the driver; and how a task's
failure is classified.

**Output** (``stream_output``, on by default): while a barrier task runs, its
``sys.stdout`` and ``sys.stderr`` are line buffers (:class:`TaskOutput`) whose complete
lines go, on a thread of their own, to the driver's
:class:`~sparktrain.driver.services.metrics_server.MetricsServer` over the job's
authenticated wire (``KIND_METRICS`` frames of JSON, never pickle), where
:mod:`sparktrain.driver.services.task_output` writes each as ``[rank r] line`` to the
driver's *current* ``sys.stdout``/``sys.stderr`` (a notebook cell, pytest's capture).
Printing never waits for the network: a line is appended to a bounded queue or
dropped. Bounds (:class:`OutputLimits`): a cap on a line's length, a rate and burst of
lines and of bytes per task, and a cap on what waits unsent. A dropped line still goes
to the executor's own stream (its log), and the driver says how many were dropped.
When the channel cannot be opened or breaks, the task says so once on its own stderr
and its output goes there only, as before; training never waits for or fails on it.
On a cluster every line also stays in the executor's log (``echo``); in local mode that
log is the driver's terminal, so lines are not written twice there.

**Failures** (:func:`classify`): an exception raised by the user's code (``ValueError``
in a ``train_fn``, a model's forward, ``torch_run``'s function) is final: the task
reports its type, message and traceback over the same channel and raises a
:class:`~sparktrain.errors.UserCodeError` naming it, which the stage runner does not
resubmit. What a lost task or executor looks like from the surviving ranks (a
sparktrain :class:`~sparktrain.errors.CommError`, a socket error, Gloo's "connection
closed by peer", the test-only injected fault) stays retryable.

Executor-side code: nothing here imports pyspark.
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import logging
import os
import re
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any, TextIO

from sparktrain.errors import SparkTrainError, UserCodeError
from sparktrain.task.faults import InjectedFaultError
from sparktrain.wire.frames import KIND_METRICS

if TYPE_CHECKING:
    from sparktrain.task.context import JobSpec
    from sparktrain.wire.connection import Connection

log = logging.getLogger(__name__)

OUTPUT = "output"
"""A message of lines: ``{"type": "output", "lines": [[stream, text], ...], "dropped": n}``
(``stream``: ``"out"`` or ``"err"``; ``dropped``: lines dropped so far)."""
OUTPUT_END = "output_end"
"""The task's last message: ``{"type": "output_end", "dropped": n}``."""
FAILURE = "failure"
"""A failure's report: ``{"type": "failure", "kind": "user" | "infra" | "sparktrain",
"error": type name, "message": ..., "traceback": ...}``."""
MESSAGE_TYPES = (OUTPUT, OUTPUT_END, FAILURE)

MAX_MESSAGE_CHARS = 8192
"""A failure report's message is cut to this; its traceback to :data:`MAX_TRACEBACK_CHARS`."""
MAX_TRACEBACK_CHARS = 65536


@dataclass(frozen=True)
class OutputLimits:
    """How much one task may stream. A longer line is cut (saying by how much); lines
    over the rate (a token bucket per task, of lines and of bytes, each with a burst)
    or beyond what may wait unsent are dropped and counted."""

    line_chars: int = 4096
    lines_per_s: float = 100.0
    burst_lines: int = 1000
    bytes_per_s: float = 128 * 1024
    burst_bytes: int = 1 << 20
    queued_bytes: int = 1 << 20
    batch_bytes: int = 64 * 1024  # one message's lines (the server reads <= 1 MiB)
    flush_s: float = 0.1  # the sender's pace: lines wait at most this long
    close_s: float = 5.0  # what a task's end waits at most for unsent lines


def _cost(line: str) -> int:
    """What a line counts against the byte caps: its UTF-8 bytes and a little framing."""
    return len(line.encode("utf-8", "replace")) + 8


class _Bucket:
    """A token bucket: ``rate`` a second, at most ``burst`` saved up."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float]) -> None:
        self._rate, self._burst, self._clock = rate, burst, clock
        self._tokens = burst
        self._at = clock()

    def take(self, amount: float) -> bool:
        now = self._clock()
        self._tokens = min(self._burst, self._tokens + (now - self._at) * self._rate)
        self._at = now
        if self._tokens < amount:
            return False
        self._tokens -= amount
        return True


Connect = Callable[[], "Connection"]


class TaskOutput:
    """One task's output stream to the driver (see the module docstring).

    ``connect`` opens the authenticated connection (on the sender thread, so a slow
    or unreachable driver never delays the task); ``echo`` writes every line to
    ``original`` too (the executor's log); ``original`` is where the task's output went
    before (and where it goes when the channel is gone)."""

    def __init__(
        self,
        connect: Connect | None,
        *,
        rank: int,
        original: dict[str, TextIO],
        echo: bool,
        limits: OutputLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rank = rank
        self.limits = limits or OutputLimits()
        self._original = original
        self._echo = echo
        self._lines = _Bucket(self.limits.lines_per_s, self.limits.burst_lines, clock)
        self._bytes = _Bucket(self.limits.bytes_per_s, self.limits.burst_bytes, clock)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._pending: dict[str, str] = {"out": "", "err": ""}
        self._queue: collections.deque[tuple[str, str]] = collections.deque()
        self._queued = 0
        self._failures: list[dict[str, Any]] = []
        self.dropped = 0
        self.sent = 0
        self._closing = False
        self._dead = connect is None  # no channel: the executor's stream only
        self._said_dead = False
        self._connect = connect
        self._conn: Connection | None = None
        self._thread: threading.Thread | None = None
        if connect is not None:
            self._thread = threading.Thread(
                target=self._send_loop, name=f"sparktrain-output-{rank}", daemon=True
            )
            self._thread.start()

    # -- the writing side (any thread of the task) --------------------------------------

    def write(self, stream: str, text: str) -> None:
        """Buffer ``text`` written to ``stream`` (``"out"``/``"err"``); queue each line it
        completes. A carriage return starts its line over (a progress bar's redraws
        leave only its last state)."""
        if not text:
            return
        with self._lock:
            buffer = self._pending[stream] + text
            *complete, rest = buffer.split("\n")
            if "\r" in rest:
                rest = rest.rsplit("\r", 1)[1]
            if len(rest) > self.limits.line_chars:  # no newline coming: do not grow
                complete.append(rest)
                rest = ""
            self._pending[stream] = rest
            for line in complete:
                self._emit(stream, line.rsplit("\r", 1)[-1])

    def flush_partial(self) -> None:
        """Queue the lines begun but not ended (the task is ending)."""
        with self._lock:
            for stream, rest in self._pending.items():
                if rest:
                    self._emit(stream, rest)
                self._pending[stream] = ""

    def _emit(self, stream: str, line: str) -> None:
        """One complete line (the lock held): cut, counted against the caps, queued."""
        cap = self.limits.line_chars
        if len(line) > cap:
            line = f"{line[:cap]} ... [{len(line) - cap} more characters cut]"
        if self._dead:
            if not self._echo:
                self._write_original(stream, line)
            return
        size = _cost(line)
        if (
            self._queued + size > self.limits.queued_bytes
            or not self._lines.take(1)
            or not self._bytes.take(size)
        ):
            self.dropped += 1
            if not self._echo:  # the executor's log keeps what the driver does not get
                self._write_original(stream, line)
            return
        self._queue.append((stream, line))
        self._queued += size
        if self._queued >= self.limits.batch_bytes:
            self._wake.notify()

    def _write_original(self, stream: str, line: str) -> None:
        with contextlib.suppress(Exception):  # a closed stream must not fail the task
            target = self._original["err" if stream == "err" else "out"]
            target.write(line + "\n")
            target.flush()

    def report_failure(self, report: dict[str, Any]) -> None:
        """Send a failure's report (:func:`failure_report`) after the lines before it."""
        with self._lock:
            if self._dead:
                return
            self._failures.append(report)
            self._wake.notify()

    # -- the sending side (its own thread) ----------------------------------------------

    def _send_loop(self) -> None:
        assert self._connect is not None
        try:
            self._conn = self._connect()
        except Exception as exc:  # CommError, OSError: the driver is unreachable
            self._go_dead(f"could not reach the driver ({exc})")
            return
        while True:
            with self._lock:
                dead = self._dead  # close() gave up meanwhile (a stuck send, no driver)
            if dead:
                self._close_conn()
                return
            with self._lock:
                if not self._queue and not self._failures and not self._closing:
                    self._wake.wait(self.limits.flush_s)
                closing = self._closing
                batch, size = [], 0
                while self._queue and size < self.limits.batch_bytes:
                    stream, line = self._queue.popleft()
                    batch.append([stream, line])
                    size += _cost(line)
                self._queued = max(0, self._queued - size) if self._queue else 0
                failures, self._failures = self._failures, []
                dropped = self.dropped
            try:
                if batch:
                    self._send({"type": OUTPUT, "lines": batch, "dropped": dropped})
                    self.sent += len(batch)
                for report in failures:
                    self._send(report)
                if closing and not batch and not failures:
                    self._send({"type": OUTPUT_END, "dropped": dropped})
                    return
            except Exception as exc:  # the channel broke: training goes on without it
                lost = [(stream, line) for stream, line in batch]
                self._go_dead(f"the channel to the driver broke ({exc})", lost)
                return

    def _send(self, message: dict[str, Any]) -> None:
        assert self._conn is not None
        self._conn.send_bytes(json.dumps(message).encode(), KIND_METRICS)

    def _go_dead(self, why: str, lost: list[tuple[str, str]] | None = None) -> None:
        """No more streaming: what waits (and ``lost``, a batch whose send failed) goes
        to the executor's stream, and the task says so once there (the driver cannot
        hear it)."""
        with self._lock:
            self._dead = True
            waiting = [*(lost or ()), *self._queue]
            self._queue.clear()
            self._queued = 0
            self.dropped += len(waiting)
            say = not self._said_dead
            self._said_dead = True
        if say:
            # said once, on the executor's stderr itself: a log warning would land there
            # a second time (logging's last-resort handler writes to sys.stderr)
            log.debug("rank %d: output not streamed to the driver: %s", self.rank, why)
            self._write_original(
                "err",
                f"sparktrain: rank {self.rank}'s output no longer reaches the driver: {why}; "
                "it goes to this executor's log only",
            )
        if not self._echo:
            for stream, line in waiting:
                self._write_original(stream, line)
        self._close_conn()

    def _close_conn(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    def close(self, reachable: bool = True) -> None:
        """Queue any unfinished line, let the sender deliver what waits (at most
        ``limits.close_s``), then close the channel. Never raises. ``reachable=False``:
        the task learned it cannot reach the driver (its rendezvous failed), so nothing
        waits for a connection that is still being tried."""
        self.flush_partial()
        if not reachable and self._conn is None:
            self._go_dead("the task could not reach the driver's services")
        with self._lock:
            self._closing = True
            self._wake.notify()
            dead = self._dead
        if self._thread is not None and not dead:  # dead: nothing left for it to send
            self._thread.join(self.limits.close_s)
            if self._thread.is_alive():  # a stuck send: give up on the rest
                self._go_dead(f"it took over {self.limits.close_s:.0f} s to deliver")
        with self._lock:  # a thread of the user's that prints on: its own stream
            self._dead = True
        self._close_conn()


class _Stream(io.TextIOBase):
    """What ``sys.stdout``/``sys.stderr`` are while a task runs: each write goes to the
    task's :class:`TaskOutput` (and, with ``echo``, to the stream it replaced). In a
    process forked from the task (a DataLoader worker), whose copy of the sender thread
    does not run, writes go to the replaced stream only."""

    def __init__(self, owner: TaskOutput, name: str, original: TextIO, echo: bool) -> None:
        super().__init__()
        self._owner, self._name, self._original, self._echo = owner, name, original, echo
        self._pid = os.getpid()

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        if os.getpid() != self._pid:
            return self._original.write(text)
        if self._echo:
            with contextlib.suppress(Exception):
                self._original.write(text)
        self._owner.write(self._name, text)
        return len(text)

    def flush(self) -> None:
        with contextlib.suppress(Exception):
            self._original.flush()

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:  # faulthandler, subprocesses: the real descriptor
        return self._original.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._original, "encoding", None) or "utf-8"

    @property
    def errors(self) -> str | None:  # type: ignore[override]
        return getattr(self._original, "errors", None)

    @property
    def buffer(self) -> Any:  # bytes written here bypass the stream, as before
        return self._original.buffer


def channel(spec: JobSpec, rank: int) -> Connect | None:
    """How this task dials the driver's metrics service (None without one)."""
    address = spec.metrics_address
    if not address:
        return None

    def connect() -> Connection:
        from sparktrain.wire.handshake import DRIVER_RANK
        from sparktrain.wire.handshake import connect as dial
        from sparktrain.wire.stats import CommStats

        return dial(
            address,
            secret=spec.secret,
            job_id=spec.job_id,
            attempt=spec.attempt,
            my_rank=rank,
            peer_rank=DRIVER_RANK,
            timeout=min(spec.config.comm_timeout, 10.0),
            stats=CommStats(),
            security=spec.security,
        )

    return connect


@contextlib.contextmanager
def capture(
    spec: JobSpec | None, rank: int, reachable: Callable[[], bool] | None = None
) -> Iterator[TaskOutput | None]:
    """Around a barrier task's work: stream its output (``stream_output``) and turn an
    exception the user's code raised into a final
    :class:`~sparktrain.errors.UserCodeError` (reported with its traceback over the
    channel first). Without a job spec (benchmarks), nothing changes. ``reachable``
    says at the end whether the task could still reach the driver's services (False
    once its rendezvous fell back to Spark's), so the end waits for no connection."""
    if spec is None:
        yield None
        return
    stream = spec.config.stream_output
    connect = channel(spec, rank)
    out = None
    saved = sys.stdout, sys.stderr
    if connect is not None or stream:
        out = TaskOutput(
            connect,
            rank=rank,
            original={"out": saved[0], "err": saved[1]},
            echo=spec.echo_output or not stream,
        )
    if stream and out is not None:
        sys.stdout = _Stream(out, "out", saved[0], out._echo)
        sys.stderr = _Stream(out, "err", saved[1], out._echo)
    try:
        try:
            yield out
        except Exception as exc:
            kind = classify(exc)
            report = failure_report(exc, kind)
            if out is not None:
                out.report_failure(report)
            if kind == "user":
                raise UserCodeError(
                    UserCodeError.headline(rank, report["error"], report["message"]),
                    rank=rank,
                    type_name=report["error"],
                    user_message=report["message"],
                    traceback_text=report["traceback"],
                ) from exc
            raise
    finally:
        if stream:
            sys.stdout, sys.stderr = saved
        if out is not None:
            out.close(reachable=reachable() if reachable is not None else True)


def captured() -> bool:
    """Whether this task's ``sys.stdout`` streams to the driver right now."""
    return isinstance(sys.stdout, _Stream)


def pump(pipe: IO[bytes], write: Callable[[str], object]) -> threading.Thread:
    """Copy a child process's output ``pipe`` line by line to ``write`` (the current
    ``sys.stdout.write``, say) on a daemon thread, until the pipe closes; returned
    started, to join once the child exited."""

    def copy() -> None:
        with contextlib.suppress(Exception):  # a closed stream: the child goes on
            for raw in iter(pipe.readline, b""):
                write(raw.decode("utf-8", "replace"))
        with contextlib.suppress(Exception):
            pipe.close()

    thread = threading.Thread(target=copy, name="sparktrain-output-pump", daemon=True)
    thread.start()
    return thread


# Gloo's and NCCL's words for a peer that went away (torch raises a plain RuntimeError)
_PEER_LOST = re.compile(
    r"gloo/transport|Connection closed by peer|Connection reset by peer|"
    r"NCCL (?:error|communicator)|ProcessGroupNCCL|Socket Timeout|TCPStore",
    re.IGNORECASE,
)
# OSErrors that say something of the user's files, not of the machine or the network
_DETERMINISTIC_OS = (
    FileNotFoundError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
    FileExistsError,
)


def classify(exc: BaseException) -> str:
    """``"sparktrain"`` for sparktrain's own errors (each keeps its meaning: a
    :class:`~sparktrain.errors.CommError` is retried, a config or data error is
    final); ``"infra"`` for what a lost task, executor or link looks like (sockets,
    memory, Spark's own task machinery, Gloo/NCCL losing a peer, the test-only injected
    fault): retried;
    ``"user"`` for anything else, an exception of the user's code: final."""
    if isinstance(exc, SparkTrainError):
        return "sparktrain"
    if isinstance(
        exc, InjectedFaultError | MemoryError | ConnectionError | TimeoutError | EOFError
    ):
        return "infra"
    if type(exc).__module__.split(".")[0] in ("pyspark", "py4j"):  # the task's own link
        return "infra"  # to Spark (a barrier call after a peer failed, a stream cut)
    if isinstance(exc, OSError) and not isinstance(exc, _DETERMINISTIC_OS):
        return "infra"
    names = {c.__name__ for c in type(exc).__mro__}
    if names & {"DistError", "DistBackendError", "DistNetworkError", "DistStoreError"}:
        return "infra"
    if isinstance(exc, RuntimeError) and _PEER_LOST.search(str(exc)):
        return "infra"
    return "user"


def type_name(exc: BaseException) -> str:
    """``ValueError`` for built-ins, ``package.module.Class`` for the rest."""
    cls = type(exc)
    if cls.__module__ == "builtins":
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


def failure_report(exc: BaseException, kind: str) -> dict[str, Any]:
    """The JSON report of a task's failure: kind, type name, message, traceback (cut)."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    if len(text) > MAX_TRACEBACK_CHARS:
        text = "... [start cut]\n" + text[-MAX_TRACEBACK_CHARS:]
    return {
        "type": FAILURE,
        "kind": kind,
        "error": type_name(exc),
        "message": str(exc)[:MAX_MESSAGE_CHARS],
        "traceback": text,
    }


__all__ = [
    "OutputLimits",
    "TaskOutput",
    "capture",
    "channel",
    "classify",
    "failure_report",
]
