"""A real standalone cluster (master + 2 workers from pyspark's bin/spark-class, on
loopback): spark-submit the shipped job, then kill an executor JVM mid-training."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .fixtures import StandaloneCluster, descendants, spark_home

pytestmark = [pytest.mark.spark, pytest.mark.cluster, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with StandaloneCluster(tmp_path_factory.mktemp("standalone"), workers=2) as c:
        yield c


def _submit(
    cluster: StandaloneCluster,
    tmp_path: Path,
    *overrides: str,
    confs: tuple[str, ...] = (),
    script: Path = ROOT / "jobs" / "train.py",
) -> subprocess.Popen:
    args = [
        str(spark_home() / "bin" / "spark-submit"),
        "--master",
        cluster.url,
        "--conf",
        "spark.driver.host=127.0.0.1",
        "--conf",
        "spark.driver.bindAddress=127.0.0.1",
        "--conf",
        "spark.ui.enabled=false",
        "--conf",
        "spark.executor.cores=1",
        "--conf",
        "spark.cores.max=2",
        "--conf",
        "spark.executor.memory=768m",
        *[arg for conf in confs for arg in ("--conf", conf)],
        str(script),
        str(ROOT / "conf" / "digits_mlp.toml"),
        "--set",
        "progress=false",
        "--summary-json",
        str(tmp_path / "summary.json"),
    ]
    for item in overrides:
        args += ["--set", item]
    log = open(tmp_path / "submit.log", "wb")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(
        args,
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**cluster.env, "PYSPARK_DRIVER_PYTHON": sys.executable},
    )


def _finish(proc: subprocess.Popen, tmp_path: Path, timeout: float = 400) -> dict:
    try:
        code = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = (tmp_path / "submit.log").read_text(errors="replace")
    assert code == 0, log[-4000:]
    return json.loads((tmp_path / "summary.json").read_text())


def test_submit_then_kill_an_executor_mid_training(cluster, tmp_path):
    """spark-submit jobs/train.py to the cluster; SIGKILL one executor JVM after the first
    checkpoint: the worker starts a new executor, the driver resubmits the stage and the
    workers resume from the checkpoint. The partitions spill (a tiny data_memory_mb), so
    the killed executor's task leaves a spill file for its successor to sweep."""
    ckpt = tmp_path / "ckpt"
    proc = _submit(
        cluster,
        tmp_path,
        "epochs=40",
        "data_memory_mb=0.05",
        f"checkpoint_dir='file://{ckpt}'",  # one machine: a disk every host shares
        "checkpoint_every=0.5",
        "comm_timeout=20.0",
    )
    try:
        deadline = time.monotonic() + 240
        while not (ckpt.exists() and any(ckpt.glob("ckpt-*.pt"))):
            assert proc.poll() is None, (tmp_path / "submit.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint appeared"
            time.sleep(0.2)
        victims = cluster.executor_pids()
        assert len(victims) == 2
        os.kill(victims[0], signal.SIGKILL)
        summary = _finish(proc, tmp_path)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert summary["world_size"] == 2 and summary["restarts"] >= 1
    assert summary["metric_value"] >= 0.95 and summary["replicas_in_sync"]
    assert summary["data_path"] == "spilled" and summary["data_spilled_bytes"] > 0
    log = (tmp_path / "submit.log").read_text(errors="replace")
    assert "from the checkpoint of step" in log


DYNAMIC_ALLOCATION = (
    "spark.dynamicAllocation.enabled=true",
    # no external shuffle service on this cluster: track shuffle files instead
    "spark.dynamicAllocation.shuffleTracking.enabled=true",
    "spark.dynamicAllocation.minExecutors=0",
    "spark.dynamicAllocation.maxExecutors=2",
    "spark.dynamicAllocation.executorIdleTimeout=5s",
)


def test_tree_aggregate_runs_under_dynamic_allocation_with_fewer_slots_than_partitions(
    cluster, tmp_path
):
    """tree_aggregate needs no gang scheduling: with dynamic allocation on (executors come
    and go) and 4 partitions for at most 2 one-core executors, it trains to the target;
    a barrier strategy under the same settings is refused at once with our message.
    With delta+ the weights go down as int8 deltas on the copy each executor's Python
    worker holds (a worker without one fetches it from the driver)."""
    proc = _submit(
        cluster,
        tmp_path,
        "strategy='tree_aggregate'",
        "num_workers=4",
        "local_steps=8",
        "compression='delta+int8+ef'",
        confs=DYNAMIC_ALLOCATION,
    )
    summary = _finish(proc, tmp_path)
    assert summary["strategy"] == "tree_aggregate" and summary["world_size"] == 4
    assert summary["metric_value"] >= 0.95
    assert summary["download_wire_bytes"] < 0.5 * summary["download_bytes"]
    refused = tmp_path / "ring"
    refused.mkdir()
    proc = _submit(cluster, refused, confs=DYNAMIC_ALLOCATION)
    code = proc.wait(timeout=300)
    log = _log(refused)
    assert code == 2, log[-3000:]
    assert "spark.dynamicAllocation.enabled=false" in log


def test_a_lost_worker_leaves_too_few_slots_and_the_run_says_so(cluster, tmp_path):
    """Kill a whole worker (its executor goes with it, and nothing replaces it): the
    resubmission finds one slot for two workers and fails with our message, not a hang,
    after the wait Spark's setting asks for (15 s here, 60 s by default)."""
    wait = "spark.scheduler.maxRegisteredResourcesWaitingTime=15s"
    proc = _submit(cluster, tmp_path, "epochs=400", "comm_timeout=20.0", confs=(wait,))
    try:
        deadline = time.monotonic() + 240
        while len(cluster.executor_pids()) < 2 or "ring on 2 workers" not in _log(tmp_path):
            assert proc.poll() is None, _log(tmp_path)[-3000:]
            assert time.monotonic() < deadline, "the job never started training"
            time.sleep(0.2)
        time.sleep(3)  # the barrier stage is running now
        _kill_worker(cluster, 1)
        code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = _log(tmp_path)
    assert code == 2, log[-3000:]
    assert "num_workers=2 needs 2 task slots at once, but spark://" in log
    assert "offers 1" in log or "offers 0" in log
    assert "waiting up to 15 s for executors" in log


HOLD_AND_TRAIN = """
import sys, threading, time

from sparktrain.cli import main
from sparktrain.session import get_or_create_session

sc = get_or_create_session().sparkContext


def hold(_):
    time.sleep(240)


# another job keeps one of the two task slots busy, so the training stage waits
threading.Thread(target=lambda: sc.parallelize([0], 1).foreach(hold), daemon=True).start()
deadline = time.monotonic() + 120
while not sc.statusTracker().getActiveStageIds() and time.monotonic() < deadline:
    time.sleep(0.2)
print("holding one task slot", flush=True)
sys.exit(main(["train", *sys.argv[1:]]))
"""


def test_a_stage_waiting_for_slots_that_are_lost_is_cancelled(tmp_path):
    """Spark checks a barrier stage's slots only when its job is submitted: the stage
    waits here for a slot held by another job, a worker dies, and only one slot is left
    for two tasks. The slot watchdog cancels the stage and the run says why (exit 2)
    instead of waiting forever."""
    script = tmp_path / "hold_and_train.py"
    script.write_text(HOLD_AND_TRAIN)
    with StandaloneCluster(tmp_path / "cluster", workers=2) as cluster:
        proc = _submit(cluster, tmp_path, "epochs=400", "comm_timeout=20.0", script=script)
        try:
            deadline = time.monotonic() + 240
            while "ring on 2 workers" not in _log(tmp_path):
                assert proc.poll() is None, _log(tmp_path)[-3000:]
                assert time.monotonic() < deadline, "the job never launched its stage"
                time.sleep(0.2)
            assert "holding one task slot" in _log(tmp_path)
            time.sleep(2)  # the stage is submitted and waits for its second slot
            _kill_worker(cluster, 1)
            code = proc.wait(timeout=240)
        finally:
            if proc.poll() is None:
                proc.kill()
    log = _log(tmp_path)
    assert code == 2, log[-3000:]
    assert "cancelling the training stage" in log
    assert "num_workers=2 needs 2 task slots at once, but spark://" in log
    assert "offers 1" in log or "offers 0" in log


def _kill_worker(cluster: StandaloneCluster, index: int) -> None:
    """SIGKILL a whole worker with its executor: nothing replaces it. A process of the
    tree may be gone by the time its turn comes (a Python worker exits with its executor
    JVM): gone is what this wanted."""
    victim = cluster.worker_procs[index]
    for pid in [*descendants(victim.pid), victim.pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    victim.wait(timeout=30)


def _log(tmp_path: Path) -> str:
    return (tmp_path / "submit.log").read_text(errors="replace")
