"""A forked Python worker whose task socket the JVM already closed ends without printing
pyspark's ``BrokenPipeError`` trace on the user's terminal (sparktrain.driver.daemon)."""

from __future__ import annotations

import subprocess
import sys

CHILD = """
import sys
from sparktrain.driver.daemon import _quiet_on_a_closed_socket

def worker(sock, authenticated):
    if sock == "closed":
        raise BrokenPipeError(32, "Broken pipe")
    if sock == "bug":
        raise ValueError("a real failure")
    return 0

run = _quiet_on_a_closed_socket(worker)
assert run("open", True) == 0
run(sys.argv[1], True)
"""


def _child(case: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", CHILD, case], capture_output=True, text=True, timeout=120
    )


def test_a_closed_socket_ends_the_worker_quietly() -> None:
    done = _child("closed")
    assert done.returncode == 1
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr


def test_other_failures_still_propagate() -> None:
    done = _child("bug")
    assert done.returncode == 1 and "ValueError: a real failure" in done.stderr
