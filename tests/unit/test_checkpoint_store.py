"""Checkpoints that survive: a truncated newest one falls back to an older intact one,
local writes are fsynced, orphaned temporary files go, per-rank shards make a
checkpoint complete, a plain path is refused where executors may sit on other hosts,
and a run with error feedback resumes to the same weights as an unbroken one."""

from __future__ import annotations

import logging
import os
import time

import pytest
import torch

from sparktrain.checkpoint import (
    ORPHAN_AGE_S,
    RANK_SHARDS,
    Checkpoint,
    CheckpointStore,
    check_shared,
    open_for_run,
)
from sparktrain.compress.base import BucketState
from sparktrain.compress.int8 import GEN_SLOT, SCRATCH_SLOT
from sparktrain.compress.snapshot import dump_states, load_states
from sparktrain.errors import CheckpointError, ConfigError, PeerLostError
from sparktrain.task.faults import FaultPlan, InjectedFaultError

from .fixtures import loop_spec, random_parts, spec_with, state_bytes, train_in_threads

pytestmark = pytest.mark.timeout(120)


def _ckpt(step: int, shards: int = 0) -> Checkpoint:
    return Checkpoint(
        step,
        {"w": torch.full((2,), float(step))},
        {},
        torch.get_rng_state(),
        [{"epoch": 0}],
        extra={RANK_SHARDS: shards} if shards else {},
    )


def _truncate(path, keep: float = 0.5) -> None:
    raw = path.read_bytes()
    path.write_bytes(raw[: int(len(raw) * keep)])


def test_a_truncated_newest_checkpoint_falls_back_to_the_newest_intact_one(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="sparktrain")
    store = CheckpointStore(str(tmp_path), keep=3)
    for step in (2, 4, 6):
        store.save(_ckpt(step))
    _truncate(tmp_path / "ckpt-000000000006.pt")  # a writer killed after the rename
    loaded = store.load()
    assert loaded is not None and loaded.step == 4
    torch.testing.assert_close(loaded.model_state["w"], torch.full((2,), 4.0))
    assert store.newest_intact() == 4
    assert "checkpoint of step 6 is unusable" in caplog.text
    assert "using the checkpoint of step 4, the newest intact one" in caplog.text
    with pytest.raises(CheckpointError, match="corrupt"):  # asked for by step: no fallback
        store.load(6)


def test_the_driver_resumes_from_the_newest_intact_checkpoint(tmp_path, caplog):
    from sparktrain.driver.stage_runner import resume_step as _resume_step

    store = CheckpointStore(str(tmp_path), keep=3)
    for step in (5, 10):
        store.save(_ckpt(step))
    _truncate(tmp_path / "ckpt-000000000010.pt")
    with caplog.at_level(logging.INFO, logger="sparktrain"):
        assert _resume_step(store, True) == 5
    # the log names the file the run continues from
    assert f"resuming from {tmp_path}/ckpt-000000000005.pt: step 5" in caplog.text
    assert _resume_step(store, False) is None


def test_when_no_checkpoint_is_intact_the_newest_ones_error_is_raised(tmp_path):
    store = CheckpointStore(str(tmp_path), keep=3)
    for step in (2, 4):
        store.save(_ckpt(step))
        _truncate(tmp_path / f"ckpt-{step:012d}.pt", 0.3)
    with pytest.raises(CheckpointError, match="000000000004.*delete it"):
        store.load()


def test_local_writes_are_fsynced_before_the_rename_and_the_directory_after(tmp_path, monkeypatch):
    synced: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    def replace(src: str, dst: str) -> None:
        synced.append(f"rename {os.path.basename(dst)}")
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    for uri in (str(tmp_path / "plain"), f"file://{tmp_path}/uri"):
        synced.clear()
        CheckpointStore(uri).save(_ckpt(1))
        directory = str(tmp_path / ("plain" if "://" not in uri else "uri"))
        assert len(synced) == 3, synced
        assert os.path.dirname(synced[0]) == directory  # the temporary file...
        assert os.path.basename(synced[0]).startswith(".tmp-")
        assert synced[1] == "rename ckpt-000000000001.pt"  # ...then the rename...
        assert synced[2] == directory  # ...then the directory entry


def test_orphaned_temporary_files_are_removed(tmp_path):
    store = CheckpointStore(str(tmp_path), keep=3)
    store.save(_ckpt(1))
    old, fresh = tmp_path / ".tmp-dead", tmp_path / ".tmp-writing"
    old.write_bytes(b"half a checkpoint")
    fresh.write_bytes(b"being written")
    past = time.time() - ORPHAN_AGE_S - 60
    os.utime(old, (past, past))
    store.save(_ckpt(2))  # every save removes stale ones...
    assert not old.exists() and fresh.exists()
    assert store.remove_orphans() == 1  # ...and a new run all of them
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt-000000000001.pt",
        "ckpt-000000000002.pt",
    ]


def test_a_new_run_refuses_a_directory_holding_an_earlier_runs_checkpoints(tmp_path):
    """Else a restart of the new run would continue from the earlier run's newer
    checkpoint, and pruning would delete the new run's own."""
    CheckpointStore(str(tmp_path), keep=3).save(_ckpt(40))
    (tmp_path / ".tmp-dead").write_bytes(b"half a checkpoint")
    with pytest.raises(CheckpointError, match="step 40.*resume=true.*empty checkpoint_dir"):
        open_for_run(str(tmp_path), 3, resume=False)
    store = open_for_run(str(tmp_path), 3, resume=True)  # continuing it is fine
    assert store.latest_step() == 40 and not (tmp_path / ".tmp-dead").exists()
    assert open_for_run(str(tmp_path / "fresh"), 3, resume=False).latest_step() is None


@pytest.mark.parametrize(
    "master",
    ["spark://10.0.0.1:7077", "yarn", "k8s://https://api:6443", "local-cluster[2,1,1024]"],
)
def test_a_plain_path_is_refused_on_a_cluster_master(tmp_path, master):
    with pytest.raises(ConfigError, match=r"hdfs://, s3://, gs://, abfs://.*file://") as exc:
        check_shared(str(tmp_path), master)
    assert f"file://{tmp_path}" in str(exc.value)  # the opt-in, spelled out
    check_shared(f"file://{tmp_path}", master)  # explicit: a disk every host shares
    check_shared("hdfs://nn:8020/ckpt", master)


@pytest.mark.parametrize("master", ["local", "local[2]", "local[*]", "local[2,3]"])
def test_a_plain_path_is_fine_on_one_host(tmp_path, master):
    check_shared(str(tmp_path), master)


def test_the_trainer_refuses_a_plain_path_on_a_cluster_before_any_job(tmp_path):
    from sparktrain.config import TrainConfig
    from sparktrain.driver.stage_runner import open_store

    cfg = TrainConfig(checkpoint_dir=str(tmp_path), num_workers=2)
    with pytest.raises(ConfigError, match="local path"):
        open_store(cfg, "spark://127.0.0.1:7077", executors_write=True)
    (tmp_path / ".tmp-leftover").write_bytes(b"x")
    assert open_store(cfg, "local[2]", executors_write=True) is not None
    assert not (tmp_path / ".tmp-leftover").exists()  # a new run clears all orphans


def test_a_checkpoint_counts_only_when_every_shard_is_there(tmp_path):
    store = CheckpointStore(str(tmp_path), keep=1)
    store.save_shard(3, 0, 2, {"x": torch.ones(1)})
    store.save(_ckpt(3, shards=2))
    store.save_shard(6, 0, 2, {"x": torch.ones(1)})
    store.save_shard(6, 1, 2, {"x": torch.ones(1)})
    store.save(_ckpt(6, shards=2))
    store.save_shard(9, 0, 2, {"x": torch.ones(1)})
    store.save(_ckpt(9, shards=2))  # rank 1's shard of step 9 has not landed yet
    assert store.steps() == [6]  # 3 lacks rank 1's shard as well
    assert store.newest_intact() == 6
    # pruning keeps the newest complete one and everything newer (shards still coming);
    # step 3 and its shard are gone
    names = sorted(p.name for p in tmp_path.iterdir())
    assert not [n for n in names if n.startswith("ckpt-000000000003")]
    assert "ckpt-000000000009.rank-00000-of-00002.pt" in names
    store.save_shard(9, 1, 2, {"x": torch.full((1,), 2.0)})
    assert store.steps() == [6, 9]
    torch.testing.assert_close(store.load_shard(9, 1, 2)["x"], torch.full((1,), 2.0))
    store.save(_ckpt(12))  # the next commit prunes 6 with its shards
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("ckpt-000000000006")]


def test_a_truncated_shard_falls_back_to_the_previous_checkpoint(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="sparktrain")
    store = CheckpointStore(str(tmp_path), keep=3)
    for step in (4, 8):
        for rank in range(2):
            store.save_shard(step, rank, 2, {"x": torch.full((100,), float(step))})
        store.save(_ckpt(step, shards=2))
    _truncate(tmp_path / "ckpt-000000000008.rank-00001-of-00002.pt")
    assert store.newest_intact() == 4
    assert "rank-00001-of-00002.pt" in caplog.text


def test_compressor_state_round_trips_through_a_checkpoint_shard(tmp_path):
    gen = torch.Generator().manual_seed(5)
    torch.rand(3, generator=gen)
    inner = BucketState(key=7, seed=1, stream=1, step=3, slots={"ef.residual": torch.ones(2)})
    states = {
        0: BucketState(
            key=0,
            shapes=((4, 3), (3,)),
            seed=11,
            step=42,
            stream=1,
            slots={
                "ef.residual": torch.arange(15.0),
                "powersgd.q": [torch.ones(3, 2), torch.zeros(1, 1)],
                "ef.scale": 17.0,
                GEN_SLOT: gen,
                SCRATCH_SLOT: torch.empty(1000),  # a work buffer: not saved
                "recompress.segments": [inner],
            },
        )
    }
    store = CheckpointStore(str(tmp_path))
    store.save_shard(1, 0, 1, {"states": dump_states(states)})
    back = load_states(store.load_shard(1, 0, 1)["states"])[0]
    assert (back.key, back.shapes, back.seed, back.step, back.stream) == (
        0,
        ((4, 3), (3,)),
        11,
        42,
        1,
    )
    assert SCRATCH_SLOT not in back.slots
    torch.testing.assert_close(back.slots["ef.residual"], torch.arange(15.0))
    assert [q.shape for q in back.slots["powersgd.q"]] == [(3, 2), (1, 1)]
    assert back.slots["ef.scale"] == 17.0
    # the private generator continues where it was
    assert torch.equal(torch.rand(4, generator=back.slots[GEN_SLOT]), torch.rand(4, generator=gen))
    sub = back.slots["recompress.segments"][0]
    assert (sub.key, sub.step) == (7, 3) and torch.equal(sub.slots["ef.residual"], torch.ones(2))


def test_unknown_compressor_state_is_refused_with_a_hint():
    with pytest.raises(TypeError, match="teach sparktrain.compress.snapshot"):
        dump_states({0: BucketState(slots={"odd": object()})})


@pytest.mark.parametrize("compression", ["int8+ef", "powersgd:2+ef"])
def test_a_compressed_run_resumed_mid_epoch_equals_an_unbroken_run(tmp_path, compression):
    """Per-rank residuals and PowerSGD's Q travel in shards: the resumed run is bitwise
    the unbroken one (without the shards the residuals restart at zero and it differs)."""
    common = {
        "epochs": 4,
        "batch_size": 3,
        "shuffle": True,
        "lr": 0.05,
        "checkpoint_every": 0.5,
        "compression": compression,
        "optimizer_kwargs": {"momentum": 0.9},
    }
    parts = random_parts([10, 7])
    unbroken = train_in_threads(loop_spec(checkpoint_dir=str(tmp_path / "a"), **common), parts)
    spec = loop_spec(checkpoint_dir=str(tmp_path / "b"), **common)
    plan = FaultPlan(rank=1, step=9, marker=str(tmp_path / "fault"))
    with pytest.raises((InjectedFaultError, PeerLostError)):
        train_in_threads(spec_with(spec, fault=plan), parts)
    store = CheckpointStore(str(tmp_path / "b"))
    resume = store.newest_intact()
    assert resume is not None and 0 < resume < 9
    shards = sorted(p.name for p in (tmp_path / "b").glob(f"ckpt-{resume:012d}.rank-*"))
    assert len(shards) == 2
    resumed = train_in_threads(spec_with(spec, fault=plan, attempt=1, resume_step=resume), parts)
    assert state_bytes(resumed) == state_bytes(unbroken)  # bitwise


def test_a_fault_series_fires_each_plan_once(tmp_path):
    plan = FaultPlan.series(
        [
            FaultPlan(rank=0, step=3, marker=str(tmp_path / "a")),
            FaultPlan(rank=1, step=5, marker=str(tmp_path / "b")),
        ]
    )
    plan.maybe_fire(1, 3)  # wrong rank: nothing
    for rank, step in ((0, 3), (1, 5)):
        with pytest.raises(InjectedFaultError, match=f"rank {rank} at step {step}"):
            plan.maybe_fire(rank, step)
        plan.maybe_fire(rank, step)  # a resumed stage passes the same step: no second fault
    with pytest.raises(ValueError, match="distinct markers"):
        FaultPlan.series([FaultPlan(0, 1, "m"), FaultPlan(1, 2, "m")])
