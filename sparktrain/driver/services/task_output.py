"""The driver's end of the tasks' output and failure reports (the tasks' end:
:mod:`sparktrain.task.output`).

The :class:`~sparktrain.driver.services.metrics_server.MetricsServer` of a stage
attempt hands every ``output``/``output_end``/``failure`` message to an
:class:`OutputSink`, with the rank the sender proved in its handshake (never a rank the
message claims). Lines go to the driver's ``sys.stdout``/``sys.stderr`` as they are
*when the line arrives* (a notebook cell's stream, pytest's capture), as
``[rank r] line``; above a live progress bar through tqdm, which redraws the bar below
them. Failure reports are kept for the stage runner: an exception of the user's code
ends the fit (:meth:`OutputSink.user_failure`) instead of resubmitting the stage.
Everything arrives as JSON; nothing from the wire is unpickled.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, TextIO

from sparktrain.errors import UserCodeError, user_code_error
from sparktrain.task.output import (
    FAILURE,
    MAX_MESSAGE_CHARS,
    MAX_TRACEBACK_CHARS,
    OUTPUT,
    OUTPUT_END,
    OutputLimits,
)

MAX_LINE_CHARS = OutputLimits().line_chars + 64
"""The driver cuts longer lines too: the task's cap, with room for its note."""


class OutputSink:
    """Writes the tasks' lines to the driver's current streams and keeps their failure
    reports. ``bar`` returns the progress display's live tqdm bar (or None), above which
    lines are written. Thread-safe: each task's connection is read on its own thread."""

    def __init__(self, *, stream: bool = True, bar: Any = None) -> None:
        self.stream = stream
        self._bar = bar
        self._lock = threading.Lock()
        self.failures: list[tuple[int, dict[str, Any]]] = []
        self.lines = 0
        self._dropped: dict[int, int] = {}

    def __call__(self, rank: int, message: dict[str, Any]) -> None:
        kind = message.get("type")
        if kind == FAILURE:
            with self._lock:
                self.failures.append((rank, message))
        elif kind == OUTPUT and self.stream:
            lines = message.get("lines")
            if isinstance(lines, list):
                for item in lines:
                    if isinstance(item, list) and len(item) == 2:
                        self._line(rank, str(item[0]), str(item[1]))
            self._note_dropped(rank, message.get("dropped"), final=False)
        elif kind == OUTPUT_END and self.stream:
            self._note_dropped(rank, message.get("dropped"), final=True)

    def _line(self, rank: int, stream: str, text: str) -> None:
        if len(text) > MAX_LINE_CHARS:
            text = text[:MAX_LINE_CHARS] + " ..."
        text = text.replace("\r", "")
        self._write(f"[rank {rank}] {text}", sys.stderr if stream == "err" else sys.stdout)
        self.lines += 1

    def _note_dropped(self, rank: int, dropped: Any, *, final: bool) -> None:
        """Say once when a rank's lines start being dropped, and the count at its end."""
        if not isinstance(dropped, int) or dropped <= 0:
            return
        with self._lock:
            before = self._dropped.get(rank, 0)
            self._dropped[rank] = dropped
        limits = OutputLimits()
        if before == 0 and not final:
            self._write(
                f"[rank {rank}] sparktrain: this rank prints more than "
                f"{limits.lines_per_s:.0f} lines or {limits.bytes_per_s / 1024:.0f} KiB a "
                "second; lines over that are dropped here (they stay in the executor's log)",
                sys.stderr,
            )
        if final:
            self._write(
                f"[rank {rank}] sparktrain: {dropped} lines of output were not streamed "
                "(over the rate cap, or the channel to the driver broke); the executor's "
                "log has them",
                sys.stderr,
            )

    def _write(self, line: str, stream: TextIO) -> None:
        with self._lock:
            try:
                bar = self._bar() if self._bar is not None else None
                if bar is not None and not getattr(bar, "disable", True):
                    type(bar).write(line, file=stream)  # clears the bar, writes, redraws
                else:
                    stream.write(line + "\n")
                    stream.flush()
            except Exception:  # the user's stream closed: the fit goes on
                pass

    def user_failure(self) -> UserCodeError | None:
        """The first failure a rank reported as the user code's own (in the order the
        reports arrived: the first raise, not a peer's reaction to it), as the
        error the fit ends with; None when no rank reported one."""
        with self._lock:
            reports = list(self.failures)
        for rank, report in reports:
            if report.get("kind") == "user":
                return from_report(rank, report)
        return None


def from_report(rank: int, report: dict[str, Any]) -> UserCodeError:
    """The driver's :class:`~sparktrain.errors.UserCodeError` of one failure report:
    the rank's exception type, message and traceback."""
    type_name = str(report.get("error", "Exception"))[:200]
    message = str(report.get("message", ""))[:MAX_MESSAGE_CHARS]
    tb = str(report.get("traceback", ""))[:MAX_TRACEBACK_CHARS]
    text = UserCodeError.headline(rank, type_name, message)
    rest = message.strip().splitlines()[1:]
    if rest:  # a message of several lines: all of it
        text += "\n" + "\n".join(rest)
    text += (
        " (raised by your code, so the stage is not resubmitted; the rank's traceback:)\n"
        + tb.rstrip()
        if tb
        else ""
    )
    return user_code_error(
        text, rank=rank, type_name=type_name, user_message=message, traceback_text=tb
    )
