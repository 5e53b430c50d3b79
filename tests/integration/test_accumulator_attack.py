"""Issue 31, point 3: silent connections to the driver's listeners, PySpark's accumulator
server among them when it is a TCP one, stall no job of a session sparktrain builds.

The victim (:mod:`tests.integration.accumulator_victim`) runs in a process of its own:
a stalled driver cannot be recovered, and the shared test session must not be the one
that stalls. It floods every TCP listener of its driver (Python process and JVM) with 20
silent connections from 127.0.0.2 before the first job, then fits the digits MLP, calls
``toArrow()`` and runs an RDD job with an accumulator. All of it must finish before the
bound (a stalled scheduler never does: measured 300 s and more); no time is asserted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sparktrain.driver.spark_env import UNIX_SOCKETS

pytestmark = [pytest.mark.spark, pytest.mark.attack, pytest.mark.timeout(1000)]

REPO = Path(__file__).resolve().parents[2]
BOUND_S = 900  # a healthy run (JVM, 3-epoch fit) took 350 s at load 26; a stalled one never ends


@pytest.mark.parametrize("master", ["local[*]", "local-cluster[2,1,1024]"])
def test_silent_connections_to_the_driver_stall_no_job(master: str) -> None:
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    try:
        done = subprocess.run(
            [sys.executable, "-m", "tests.integration.accumulator_victim", master],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=BOUND_S,
        )
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stderr or b"")[-3000:]
        pytest.fail(
            f"the fit, toArrow() or the accumulator job did not finish within {BOUND_S} s "
            f"while silent connections held the driver's listeners: Spark's scheduler "
            f"stalled (is {UNIX_SOCKETS} set?)\n{tail!r}"
        )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(report, indent=1))
    assert report["setting"] == "true"
    assert report["accumulator_tcp"] is None  # on a Unix socket: no port to connect to
    assert report["attacked"] and all(n > 0 for n in report["attacked"].values())
    assert report["metric"] > 0.5  # it trained
    assert report["rows"] == 100
    assert report["accumulated"] == 45
