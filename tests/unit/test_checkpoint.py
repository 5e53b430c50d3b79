"""Checkpoints: atomic, pruned, safe to load, and a resumed run equals an unbroken one."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from sparktrain.checkpoint import Checkpoint, CheckpointStore
from sparktrain.errors import CheckpointError, PeerLostError
from sparktrain.task.faults import FaultPlan, InjectedFaultError

from .fixtures import loop_spec, random_parts, spec_with, state_bytes, train_in_threads

pytestmark = pytest.mark.timeout(120)


def _ckpt(step: int) -> Checkpoint:
    return Checkpoint(
        step, {"w": torch.full((2,), float(step))}, {}, torch.get_rng_state(), [{"epoch": 0}]
    )


@pytest.mark.parametrize("as_uri", [False, True])
def test_save_load_prune(tmp_path, as_uri):
    uri = f"file://{tmp_path}/ck" if as_uri else str(tmp_path / "ck")
    store = CheckpointStore(uri, keep=2)
    assert store.load() is None and store.latest_step() is None
    for step in (3, 6, 9):
        store.save(_ckpt(step))
    assert store.steps() == [6, 9]
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [
        "ckpt-000000000006.pt",
        "ckpt-000000000009.pt",
    ]  # no temporary files left behind
    loaded = store.load()
    assert loaded is not None and loaded.step == 9 and loaded.history == [{"epoch": 0}]
    torch.testing.assert_close(loaded.model_state["w"], torch.full((2,), 9.0))


class _Gadget:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))  # would create the marker file if ever unpickled


def test_a_pickle_gadget_in_the_checkpoint_dir_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    store = CheckpointStore(str(tmp_path), keep=3)
    (tmp_path / "ckpt-000000000001.pt").write_bytes(
        pickle.dumps({"format": 1, "x": _Gadget(str(marker))})
    )
    with pytest.raises(CheckpointError, match="not a sparktrain checkpoint"):
        store.load()
    assert not marker.exists()


def test_a_corrupt_checkpoint_says_what_to_do(tmp_path):
    (tmp_path / "ckpt-000000000004.pt").write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointError, match="delete it or point checkpoint_dir elsewhere"):
        CheckpointStore(str(tmp_path)).load()


def test_a_run_resumed_mid_epoch_equals_an_unbroken_run(tmp_path):
    common = {
        "epochs": 4,
        "batch_size": 3,
        "shuffle": True,
        "optimizer_kwargs": {"momentum": 0.9},
        "lr": 0.05,
        "checkpoint_every": 0.5,
    }
    parts = random_parts([10, 7])
    unbroken = train_in_threads(loop_spec(checkpoint_dir=str(tmp_path / "a"), **common), parts)

    spec = loop_spec(checkpoint_dir=str(tmp_path / "b"), **common)
    plan = FaultPlan(rank=1, step=9, marker=str(tmp_path / "fault"))
    with pytest.raises((InjectedFaultError, PeerLostError)):  # rank 1 fails, rank 0 loses it
        train_in_threads(spec_with(spec, fault=plan), parts)
    store = CheckpointStore(str(tmp_path / "b"))
    resume = store.latest_step()
    assert resume is not None and 0 < resume < 9  # checkpoints every 2 steps (half an epoch)
    resumed = train_in_threads(spec_with(spec, fault=plan, attempt=1, resume_step=resume), parts)
    assert state_bytes(resumed) == state_bytes(
        unbroken
    )  # bitwise: same batches, same optimizer state
    meta = json.loads(next(r.data for out in resumed for r in out if r.kind == "meta"))
    assert [h["epoch"] for h in meta["history"]] == [0, 1, 2, 3]
