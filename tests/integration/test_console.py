"""What a user's terminal shows when sparktrain handles a failure (issue 32.3): one
subprocess runs the scenarios of console_script.py on local[2]; its console (stdout and
stderr) must hold each failure's one clear line and no Java or Python stack trace."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.spark, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]

# What a stack trace, Spark's per-task failure lines or the broken-off warm-up print.
NOISE = (
    "Traceback (most recent call last)",
    "\tat ",  # a JVM stack frame
    "BrokenPipeError",
    "ERROR Executor",
    "Lost task",
    "does not exist",  # Block broadcast_0 does not exist
    "TaskCompletionListener",
)


@pytest.fixture(scope="module")
def console(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    debug_log = tmp_path_factory.mktemp("console") / "debug.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPARK_LOCAL_IP": "127.0.0.1"}
    env.setdefault("PYSPARK_PYTHON", sys.executable)
    done = subprocess.run(
        [sys.executable, "-m", "tests.integration.console_script", str(debug_log)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=540,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:]
    return done.stdout, debug_log.read_text()


def test_handled_failures_print_one_line_each_and_no_trace(console: tuple[str, str]) -> None:
    out, _ = console
    found = [noise for noise in NOISE if noise in out]
    assert not found, f"{found} on the console:\n{out[-6000:]}"
    assert "caught: DataError: data has no column 'nope'" in out
    assert "resubmitting it (restart 1 of 2)" in out and "recovered: restarts=1" in out
    assert "caught: DataError: rank 0: labels must be integral class indices 0..9" in out
    assert out.rstrip().endswith("done")


def test_the_traces_go_to_the_debug_log(console: tuple[str, str]) -> None:
    _, debug = console
    assert "the Spark error behind this failure" in debug
    assert "Traceback (most recent call last)" in debug
