"""A job run as a user runs it leaves no folder behind (issue 32.6): pipeline_digits.py
saves and reloads its PipelineModel through a scratch folder when no --save is given, and
Spark's own scratch (block manager, pyspark's and the user files' folders) goes away with
the session. Every temporary location points into one empty folder, which must be empty
again when the job ends."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.spark, pytest.mark.timeout(400)]

ROOT = Path(__file__).resolve().parents[2]


def test_pipeline_digits_without_save_leaves_its_scratch_folder_empty(tmp_path: Path) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "SPARK_LOCAL_IP": "127.0.0.1",
        "TMPDIR": str(scratch),  # Python's tempfile
        "SPARK_LOCAL_DIRS": str(scratch),  # Spark's local dirs, pyspark's temp folder
    }
    env.setdefault("PYSPARK_PYTHON", sys.executable)
    done = subprocess.run(
        [sys.executable, "jobs/pipeline_digits.py", "--epochs", "1"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=360,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:]
    assert "save/load round trip checked" in done.stdout, done.stdout[-2000:]
    # torch's own compile cache (torchinductor_<user>), which any optimizer step creates
    # and later runs reuse by design, is not a leftover of the job
    left = sorted(p.name for p in scratch.iterdir() if not p.name.startswith("torchinductor_"))
    assert not left, f"left behind in the job's temporary folder: {left}"
