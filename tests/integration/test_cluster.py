"""Two executor processes (local-cluster[2,1,1024]) and spark-submit of the shipped job."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sparktrain import Trainer

from .helpers import DIGITS_MODEL, digits_frames, fast_config

pytestmark = [pytest.mark.spark, pytest.mark.timeout(400)]

ROOT = Path(__file__).resolve().parents[2]


def test_local_cluster_smoke(spark_cluster):
    sc = spark_cluster.sparkContext
    train, test = digits_frames(spark_cluster)
    result = Trainer(DIGITS_MODEL, fast_config(epochs=5), spark=spark_cluster).fit(
        train, validation_data=test
    )
    assert sc.master.startswith("local-cluster")
    assert result.summary["metric_value"] > 0.9
    assert result.summary["replicas_in_sync"]


def test_spark_submit_job(tmp_path):
    from pyspark.find_spark_home import _find_spark_home

    submit = Path(_find_spark_home()) / "bin" / "spark-submit"
    out = tmp_path / "summary.json"
    env = {
        **os.environ,
        "SPARK_LOCAL_IP": "127.0.0.1",
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
    }
    proc = subprocess.run(
        [
            str(submit),
            "--master",
            "local[2]",
            "--conf",
            "spark.driver.host=127.0.0.1",
            "--conf",
            "spark.ui.enabled=false",
            str(ROOT / "jobs" / "train.py"),
            str(ROOT / "conf" / "digits_mlp.toml"),
            "--set",
            "epochs=2",
            "--set",
            "progress=false",
            "--summary-json",
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "test accuracy" in proc.stdout
    assert json.loads(out.read_text())["epochs"] == 2
