"""The tasks' output stream and failure reports without Spark (issue 35.5/35.6): lines,
caps and a broken channel on the task's side (sparktrain.task.output), the driver's
sink (sparktrain.driver.services.task_output) writing to the *current* sys.stdout, the
two over a real authenticated MetricsServer, and which exceptions are final."""

from __future__ import annotations

import errno
import io
import json
import pickle
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from sparktrain.driver.services.metrics_server import MetricsServer, ProgressDisplay
from sparktrain.driver.services.task_output import OutputSink
from sparktrain.errors import (
    CommError,
    ConfigError,
    PeerLostError,
    UserCodeError,
    WorkerError,
    user_code_error,
)
from sparktrain.task import output
from sparktrain.task.faults import InjectedFaultError
from sparktrain.task.output import OutputLimits, TaskOutput, capture, classify

SECRET = b"s" * 32


class FakeConn:
    """Records what the sender sends; ``fail_after`` sends, then breaks."""

    def __init__(self, fail_after: int | None = None) -> None:
        self.messages: list[dict[str, Any]] = []
        self.fail_after = fail_after
        self.closed = False

    def send_bytes(self, payload: bytes, kind: int) -> None:
        if self.fail_after is not None and len(self.messages) >= self.fail_after:
            raise CommError("the driver went away")
        self.messages.append(json.loads(payload))

    def close(self) -> None:
        self.closed = True

    def lines(self) -> list[list[str]]:
        return [line for m in self.messages if m["type"] == "output" for line in m["lines"]]


def task_output(
    conn: Any, *, echo: bool = False, limits: OutputLimits | None = None, **kw: Any
) -> tuple[TaskOutput, dict[str, io.StringIO]]:
    original = {"out": io.StringIO(), "err": io.StringIO()}
    connect = (lambda: conn) if conn is not None else None
    out = TaskOutput(connect, rank=1, original=original, echo=echo, limits=limits, **kw)  # type: ignore[arg-type]
    return out, original


def test_lines_are_split_carriage_returns_start_over_and_the_last_line_is_flushed():
    conn = FakeConn()
    out, original = task_output(conn)
    out.write("out", "one\ntw")
    out.write("out", "o\nbar 10%\rbar 100%\n")
    out.write("err", "oops\n")
    out.write("out", "no newline")
    out.close()
    assert conn.lines() == [
        ["out", "one"],
        ["out", "two"],
        ["out", "bar 100%"],
        ["err", "oops"],
        ["out", "no newline"],
    ]
    assert conn.messages[-1] == {"type": "output_end", "dropped": 0}
    assert conn.closed and original["out"].getvalue() == ""  # no echo asked


def test_a_long_line_is_cut_and_an_endless_one_does_not_grow():
    conn = FakeConn()
    out, _ = task_output(conn, limits=OutputLimits(line_chars=10))
    out.write("out", "x" * 25 + "\n")
    out.write("out", "y" * 15)  # no newline ever: still sent, cut
    out.close()
    assert conn.lines() == [
        ["out", "x" * 10 + " ... [15 more characters cut]"],
        ["out", "y" * 10 + " ... [5 more characters cut]"],
    ]


def test_lines_over_the_rate_are_dropped_counted_and_kept_in_the_executor_log():
    now = [0.0]
    conn = FakeConn()
    limits = OutputLimits(lines_per_s=10, burst_lines=5)
    out, original = task_output(conn, limits=limits, clock=lambda: now[0])
    for i in range(8):
        out.write("out", f"line {i}\n")
    now[0] = 0.3  # three more lines' worth of tokens
    for i in range(8, 12):
        out.write("out", f"line {i}\n")
    out.close()
    sent = [text for _, text in conn.lines()]
    assert sent == [f"line {i}" for i in (0, 1, 2, 3, 4, 8, 9, 10)]
    assert out.dropped == 4 and conn.messages[-1] == {"type": "output_end", "dropped": 4}
    assert original["out"].getvalue().split("\n")[:-1] == ["line 5", "line 6", "line 7", "line 11"]


def test_a_byte_rate_caps_long_lines_too():
    conn = FakeConn()
    limits = OutputLimits(bytes_per_s=1, burst_bytes=100)
    out, _ = task_output(conn, limits=limits, clock=lambda: 0.0)
    for _ in range(5):
        out.write("out", "z" * 40 + "\n")
    out.close()
    assert len(conn.lines()) == 2 and out.dropped == 3


def test_an_unreachable_driver_is_said_once_and_output_stays_on_the_executor():
    def refuse() -> Any:
        raise CommError("connection refused")

    original = {"out": io.StringIO(), "err": io.StringIO()}
    out = TaskOutput(refuse, rank=3, original=original, echo=False)
    until(lambda: "no longer reaches" in original["err"].getvalue())
    out.write("out", "a\nb\n")
    out.close()
    assert original["out"].getvalue() == "a\nb\n"
    err = original["err"].getvalue()
    assert err.count("no longer reaches the driver") == 1 and "connection refused" in err


def test_a_channel_that_breaks_drops_with_a_count_and_never_raises():
    conn = FakeConn(fail_after=1)
    out, original = task_output(conn)
    out.write("out", "first\n")
    until(lambda: conn.messages)  # the sender sent it
    out.write("out", "second\n")
    until(lambda: out._dead)  # its send broke the channel
    out.write("out", "third\n")  # after: straight to the executor's stream
    out.close()
    assert conn.lines() == [["out", "first"]]
    assert out.dropped == 1
    assert original["out"].getvalue() == "second\nthird\n"  # the executor's log has all
    assert original["err"].getvalue().count("no longer reaches the driver") == 1


def until(condition: Any, limit_s: float = 10.0) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, "never happened"
        time.sleep(0.01)


def fake_spec(stream: bool = True, address: str | None = None) -> Any:
    config = SimpleNamespace(stream_output=stream, comm_timeout=5.0)
    return SimpleNamespace(
        config=config,
        metrics_address=address,
        echo_output=False,
        secret=SECRET,
        job_id="j",
        attempt=0,
        security=None,
    )


def test_capture_turns_a_user_exception_into_a_final_error_and_restores_the_streams():
    before = sys.stdout, sys.stderr
    with (
        pytest.raises(UserCodeError, match="rank 2 raised ValueError: bad lr") as info,
        capture(fake_spec(), 2),
    ):
        raise ValueError("bad lr\nsecond line")
    assert (sys.stdout, sys.stderr) == before
    assert isinstance(info.value.__cause__, ValueError)
    assert info.value.rank == 2 and "raise ValueError" in info.value.traceback_text
    # sparktrain's own errors and what a lost peer looks like pass through unchanged
    for exc in (PeerLostError(0, "gone"), InjectedFaultError("x"), ConfigError("y")):
        with pytest.raises(type(exc)), capture(fake_spec(), 0):
            raise exc


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (ValueError("x"), "user"),
        (KeyError("k"), "user"),
        (FileNotFoundError(errno.ENOENT, "no such file"), "user"),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), "user"),
        (InjectedFaultError("injected"), "infra"),
        (ConnectionResetError(errno.ECONNRESET, "reset"), "infra"),
        (TimeoutError("timed out"), "infra"),
        (MemoryError(), "infra"),
        (OSError(errno.EIO, "I/O error"), "infra"),
        (RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer"), "infra"),
        (CommError("lost"), "sparktrain"),
        (WorkerError("w"), "sparktrain"),
    ],
)
def test_which_failures_are_the_users_own(exc: BaseException, kind: str):
    assert classify(exc) == kind


def test_torch_distributed_errors_are_infrastructure():
    dist_error = type("DistNetworkError", (RuntimeError,), {})
    assert classify(dist_error("store went away")) == "infra"


def test_the_sink_writes_to_the_current_stdout_with_the_rank(capsys):
    sink = OutputSink()  # made before pytest's capture swapped nothing: looked up per line
    swapped = io.StringIO()
    saved = sys.stdout
    sys.stdout = swapped
    try:
        sink(1, {"type": "output", "lines": [["out", "hello"], ["err", "warn\r"]], "dropped": 0})
    finally:
        sys.stdout = saved
    assert swapped.getvalue() == "[rank 1] hello\n"
    assert capsys.readouterr().err == "[rank 1] warn\n"


def test_the_sink_says_once_that_lines_are_dropped_and_counts_them_at_the_end(capsys):
    sink = OutputSink()
    for dropped in (3, 9):
        sink(0, {"type": "output", "lines": [], "dropped": dropped})
    sink(0, {"type": "output_end", "dropped": 12})
    err = capsys.readouterr().err
    assert err.count("lines over that are dropped here") == 1
    assert "[rank 0] sparktrain: 12 lines of output were not streamed" in err


def test_the_first_user_failure_becomes_the_fits_error_with_its_type_and_traceback():
    sink = OutputSink(stream=False)
    sink(0, {"type": "failure", "kind": "infra", "error": "RuntimeError", "message": "gloo"})
    sink(1, {"type": "failure", "kind": "user", "error": "KeyError", "message": "'w'",
             "traceback": "Traceback ...\nKeyError: 'w'\n"})  # fmt: skip
    sink(0, {"type": "failure", "kind": "user", "error": "ValueError", "message": "later"})
    err = sink.user_failure()
    assert isinstance(err, KeyError) and isinstance(err, UserCodeError)
    assert err.rank == 1 and err.type_name == "KeyError" and err.user_message == "'w'"
    assert str(err).startswith("rank 1 raised KeyError: 'w'")
    assert "Traceback ...\nKeyError: 'w'" in str(err)
    assert OutputSink().user_failure() is None


def test_a_user_error_survives_spark_text_and_pickle():
    text = (
        "Traceback (most recent call last):\n  ...\nValueError: nope\n\nThe above exception "
        "was the direct cause of the following exception:\n\n"
        "sparktrain.errors.UserCodeError: rank 0 raised ValueError: nope\n"
    )
    err = WorkerError.from_spark(RuntimeError(text))
    assert isinstance(err, UserCodeError) and isinstance(err, ValueError)
    assert (err.rank, err.type_name, err.user_message) == (0, "ValueError", "nope")
    back = pickle.loads(pickle.dumps(user_code_error("m", rank=2, type_name="mod.Custom")))
    assert type(back) is UserCodeError and back.rank == 2 and back.type_name == "mod.Custom"


def test_lines_and_a_failure_travel_over_the_authenticated_metrics_channel(capsys):
    display = ProgressDisplay(enabled=False)
    sink = OutputSink()
    server = MetricsServer(
        "127.0.0.1", secret=SECRET, job_id="j", attempt=0, on_message=display, on_output=sink
    )
    try:
        spec = fake_spec(address=server.address)
        with pytest.raises(UserCodeError), capture(spec, 1):  # type: ignore[arg-type]
            print("from the task")
            print("to stderr", file=sys.stderr)
            raise ValueError("boom")
        # a stranger without the secret gets nothing through
        stranger = TaskOutput(
            output.channel(SimpleNamespace(**{**vars(spec), "secret": b"x" * 32}), 0),  # type: ignore[arg-type]
            rank=0,
            original={"out": io.StringIO(), "err": io.StringIO()},
            echo=False,
        )
        stranger.write("out", "forged\n")
        stranger.close()
    finally:
        server.stop()
    out, err = capsys.readouterr()
    assert "[rank 1] from the task\n" in out and "forged" not in out
    assert "[rank 1] to stderr\n" in err
    failure = sink.user_failure()
    assert failure is not None and failure.rank == 1 and "boom" in failure.user_message
    assert display.history == []  # output is not a progress record


def test_a_forked_child_writes_to_the_stream_it_replaced():
    out, original = task_output(FakeConn())
    stream = output._Stream(out, "out", original["out"], echo=False)
    stream._pid = -1  # as in a process forked from the task
    stream.write("from a child\n")
    out.close()
    assert original["out"].getvalue() == "from a child\n"


def test_printing_never_waits_for_a_stuck_driver():
    gate = threading.Event()

    class Stuck(FakeConn):
        def send_bytes(self, payload: bytes, kind: int) -> None:
            gate.wait(10)

    limits = OutputLimits(queued_bytes=1000, close_s=0.2)
    out, _ = task_output(Stuck(), limits=limits)
    for i in range(2000):  # the queue fills: the rest is dropped, not waited for
        out.write("out", f"line {i}\n")
    out.close()  # gives up after close_s on the stuck send
    gate.set()
    assert out.dropped > 1000 and out._dead


def test_local_mode_processes_lines_reach_the_driver_with_their_rank(tmp_path, capsys):
    from sparktrain.torch_distributor import run_local

    script = tmp_path / "hello.py"
    script.write_text("import os, sys\nprint('hi', os.environ['RANK'])\nsys.stderr.write('e')\n")
    run_local(2, [str(script)], {})
    out, err = capsys.readouterr()
    assert "[rank 0] hi 0\n" in out and "[rank 1] hi 1\n" in out
    assert "[rank 0] e\n" in err and "[rank 1] e\n" in err


def test_a_task_that_met_without_the_driver_does_not_wait_for_its_connection():
    release = threading.Event()

    def slow_dial() -> Any:
        release.wait(30)  # a dial to an unreachable driver, still being retried
        return FakeConn()

    original = {"out": io.StringIO(), "err": io.StringIO()}
    out = TaskOutput(
        slow_dial, rank=0, original=original, echo=False, limits=OutputLimits(close_s=600)
    )
    out.write("out", "kept\n")
    out.close(reachable=False)  # returns at once, not after close_s
    release.set()
    assert original["out"].getvalue() == "kept\n"
    assert "could not reach the driver's services" in original["err"].getvalue()
