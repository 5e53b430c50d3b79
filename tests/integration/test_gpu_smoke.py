"""jobs/gpu_smoke.py --dry-run: the one-GPU check's placement, collective and fit on the
CPU, in a process of its own (it starts its own local-cluster session)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.spark,
    pytest.mark.scale,  # a local-cluster of its own: 1.5-3.5 min on 2 busy cores
    pytest.mark.timeout(700),
]

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_smoke_dry_run(tmp_path):
    out = tmp_path / "smoke.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "jobs" / "gpu_smoke.py"),
            "--dry-run",
            "--epochs",
            "8",
            "--json",
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    checks = json.loads(out.read_text())["checks"]
    assert checks["placement"] == "OK task GPU 0 -> cpu"
    assert checks["collective"] == "OK gloo all_reduce on cpu"
    assert checks["fit"].startswith("OK digits accuracy")
    assert "passed" in run.stdout
