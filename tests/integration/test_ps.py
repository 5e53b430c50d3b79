"""The parameter server end to end on local[2]: real barrier stages, the PS in the driver."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sparktrain import Trainer
from sparktrain.checkpoint import CheckpointStore
from sparktrain.strategies.ps import server_persist as persist

from .fixtures import DIGITS_MODEL, accuracy, digits, digits_frames, fast_config

pytestmark = [pytest.mark.spark]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("mode", "floor", "extra"),
    [
        ("sync", 0.95, {}),
        ("async", 0.93, {}),
        ("ssp", 0.93, {"staleness": 2, "staleness_lr": True}),
    ],
)
def test_digits_mlp_through_the_parameter_server(spark, mode, floor, extra):
    train, test = digits_frames(spark)
    cfg = fast_config(strategy="ps", ps_mode=mode, ps_shards=2, **extra)
    result = Trainer(DIGITS_MODEL, cfg, spark=spark).fit(train, validation_data=test)
    s = result.summary
    assert s["strategy"] == "ps" and s["metric_value"] >= floor
    split = digits()
    # the returned model holds the server's parameters
    assert accuracy(result.model, split.x_test, split.y_test) >= floor
    ps = s["ps"]
    steps = s["steps_per_epoch"] * cfg.epochs
    assert ps["mode"] == mode and ps["shards"] == 2 and ps["failure"] is None
    assert ps["pushes"] == steps * 2 * 2  # every rank, every step, every shard
    assert ps["duplicates"] == 0 and ps["rejected"] == 0
    assert ps["bytes_in"] > 0 and ps["bytes_out"] > 0
    assert len(ps["wait_s_per_rank"]) == 2
    if mode == "sync":
        assert s["replicas_in_sync"] and ps["staleness_hist"] == {}
    else:
        assert sum(ps["staleness_hist"].values()) > 0
    if mode == "ssp":
        assert ps["max_ssp_gap"] <= 2
    assert s["bytes_sent"] > 0 and s["wire_bytes"] > s["bytes_sent"]
    assert not [t for t in threading.enumerate() if t.name.startswith("sparktrain-ps-")]


# ---------------------------------------------------------------------- driver restart

_DRIVER_TOML = """
strategy = "ps"
ps_mode = "sync"
ps_shards = 2
epochs = {epochs}
batch_size = 32
lr = 0.05
optimizer = "sgd"
num_workers = 2
seed = 0
comm_timeout = 30.0
progress = false
checkpoint_dir = "{ckpt}"
checkpoint_every = 1.0
resume = true

[optimizer_kwargs]
momentum = 0.9

[job]
model = "sparktrain.models:digits_mlp"
dataset = "digits"
"""


def _driver(config: Path, summary: Path, log: Path) -> subprocess.Popen[bytes]:
    """``sparktrain train`` on local[2] in a process of its own (its own JVM)."""
    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable}
    with log.open("ab") as out:
        return subprocess.Popen(
            [
                sys.executable, "-c", "import sys; from sparktrain.cli import main; "
                "sys.exit(main())", "train", str(config), "--master", "local[2]",
                "--summary-json", str(summary),
            ],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip


def _kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the driver (no goodbye, no finally) and then whatever it started."""
    from .fixtures import descendants

    children = descendants(proc.pid)
    proc.kill()
    proc.wait(30)
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.soak  # two drivers, each with its own JVM: minutes on a shared machine
@pytest.mark.timeout(900)
def test_a_killed_driver_resumes_from_the_servers_checkpoint(tmp_path):
    """The driver (server in it) is SIGKILLed once the server has checkpointed; the same
    command with resume=true finishes the run, and the server's version still equals the
    steps its ledger applied (no step twice): before the kill in the checkpoint, after
    the restart in the summary."""
    # the kill lags the first checkpoint, most on a loaded machine, and a short digits run
    # can end inside that lag: 30 epochs leave room to kill it mid-run
    epochs = 30
    ckpt = tmp_path / "ckpt"
    config = tmp_path / "ps.toml"
    config.write_text(_DRIVER_TOML.format(epochs=epochs, ckpt=ckpt))
    summary, log = tmp_path / "summary.json", tmp_path / "driver.log"
    store = CheckpointStore(str(ckpt / "ps"))

    first = _driver(config, summary, log)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and first.poll() is None and not store.steps():
            time.sleep(0.05)
        assert store.steps(), f"no server checkpoint; driver log:\n{log.read_text()[-3000:]}"
    finally:
        _kill_tree(first)
    assert first.returncode == -signal.SIGKILL and not summary.exists()  # killed mid-run
    ckpt_before = store.load()
    assert ckpt_before is not None
    assert len(ckpt_before.history) < epochs, (
        f"the kill came after the last checkpoint (step {ckpt_before.step}): nothing left "
        "to resume; the run is too short for this machine's kill latency"
    )
    before = persist.from_checkpoint(ckpt_before)
    for shard in before["shards"]:
        assert shard["version"] == shard["applied"] == ckpt_before.step > 0
    assert [h["epoch"] for h in ckpt_before.history] == list(range(len(ckpt_before.history)))

    second = _driver(config, summary, log)
    try:
        assert second.wait(300) == 0, log.read_text()[-3000:]
    finally:
        _kill_tree(second)
    s = json.loads(summary.read_text())
    total = epochs * s["steps_per_epoch"]
    text = log.read_text()
    resumed_at = max(store.steps())  # newest, written by the resumed run
    assert resumed_at > ckpt_before.step
    assert f"parameter server resumed from the checkpoint of step {ckpt_before.step}" in text
    assert s["ps_version"] == s["ps_applied_pushes"] == total  # every step exactly once
    assert s["ps"]["duplicates"] == 0 and s["ps"]["failure"] is None
    assert [h["epoch"] for h in s["history"]] == list(range(epochs))
    assert s["metric_value"] >= 0.9
    print(
        f"ps driver restart: killed after the checkpoint of step {ckpt_before.step} "
        f"(version {[sh['version'] for sh in before['shards']]} == applied "
        f"{[sh['applied'] for sh in before['shards']]}); resumed run: ps_version "
        f"{s['ps_version']} == ps_applied_pushes {s['ps_applied_pushes']} == {total} steps"
    )


# ---------------------------------------------------------------------- long-lived driver


@pytest.mark.timeout(240)
def test_a_ps_fit_succeeds_with_1100_descriptors_open_in_the_driver(spark, tmp_path):
    """A notebook driver soon holds more than 1,024 descriptors: nothing on the server's
    path may use select.select (which fails above FD_SETSIZE)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 1100 + 512
    if soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            pytest.fail(f"RLIMIT_NOFILE hard limit {hard} < {need}: cannot run this test")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    held = [open(os.devnull, "rb") for _ in range(1100)]  # noqa: SIM115
    try:
        assert max(f.fileno() for f in held) >= 1100  # sockets opened now land above 1024
        train, test = digits_frames(spark)
        cfg = fast_config(strategy="ps", ps_mode="sync", ps_shards=2, epochs=2)
        result = Trainer(DIGITS_MODEL, cfg, spark=spark).fit(train, validation_data=test)
        s = result.summary
        assert s["ps"]["failure"] is None
        assert s["ps_version"] == s["ps_applied_pushes"] == 2 * s["steps_per_epoch"]
    finally:
        for f in held:
            f.close()
        if soft < need:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
