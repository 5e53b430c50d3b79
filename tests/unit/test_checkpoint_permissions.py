"""Checkpoints on a local disk are the owner's alone: files 0600, the directories
sparktrain creates 0700 whatever the umask, and a directory other users could write to
(world-writable, or another user's) is refused with a message that says what to do."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from sparktrain.checkpoint import RANK_SHARDS, Checkpoint, CheckpointStore, open_for_run
from sparktrain.errors import CheckpointError

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def usual_umask():
    # the usual 022 would leave 0644 files and 0755 directories: the modes must not be
    # the umask's doing
    old = os.umask(0o022)
    yield
    os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _ckpt(step: int, shards: int = 0) -> Checkpoint:
    return Checkpoint(
        step,
        {"w": torch.full((2,), float(step))},
        {},
        torch.get_rng_state(),
        [{"epoch": 0}],
        extra={RANK_SHARDS: shards} if shards else {},
    )


def _write_all(store: CheckpointStore) -> None:
    store.save_shard(3, 0, 1, {"residual": torch.zeros(2)})
    store.save(_ckpt(3, shards=1))
    store.save_best(_ckpt(3))


@pytest.mark.parametrize("as_uri", [False, True], ids=["path", "file-uri"])
def test_files_are_0600_and_created_directories_0700(tmp_path, as_uri):
    os.chmod(tmp_path, 0o755)
    target = tmp_path / "runs" / "a" / "ckpt"
    store = CheckpointStore(target.as_uri() if as_uri else str(target), keep=2)
    _write_all(store)

    names = sorted(p.name for p in target.iterdir())
    assert names == ["best.pt", "ckpt-000000000003.pt", "ckpt-000000000003.rank-00000-of-00001.pt"]
    assert {name: _mode(target / name) for name in names} == dict.fromkeys(names, 0o600)
    for created in (tmp_path / "runs", tmp_path / "runs" / "a", target):
        assert _mode(created) == 0o700
    assert _mode(tmp_path) == 0o755  # a directory that was there keeps its mode
    assert store.load().step == 3  # and it all reads back


def test_an_existing_checkpoint_dir_keeps_its_mode_and_old_files_are_rewritten_private(
    tmp_path,
):
    os.chmod(tmp_path, 0o750)
    (tmp_path / "best.pt").write_bytes(b"")  # as an earlier version left it: 0644
    assert _mode(tmp_path / "best.pt") == 0o644
    CheckpointStore(str(tmp_path)).save_best(_ckpt(1))
    assert _mode(tmp_path) == 0o750
    assert _mode(tmp_path / "best.pt") == 0o600


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o703], ids=["0777", "sticky-1777", "0703"])
def test_a_world_writable_checkpoint_dir_is_refused(tmp_path, mode):
    target = tmp_path / "shared"
    target.mkdir()
    os.chmod(target, mode)
    with pytest.raises(CheckpointError, match="world-writable") as info:
        open_for_run(str(target), 3, resume=False)
    assert "chmod o-w" in str(info.value)
    assert list(target.iterdir()) == []  # refused before anything was written


def test_a_checkpoint_dir_made_world_writable_after_opening_is_refused_at_the_write(tmp_path):
    target = tmp_path / "late"
    store = CheckpointStore(str(target))  # nothing there yet: checked when written
    target.mkdir()
    os.chmod(target, 0o777)  # another user got there first
    with pytest.raises(CheckpointError, match="world-writable"):
        store.save(_ckpt(1))
    assert list(target.iterdir()) == []


def _owned_by(monkeypatch, path, uid: int) -> None:
    """``os.stat`` of ``path`` says ``uid`` owns it (the tests run as root, who may
    not give a file away and take it back in a test)."""
    real = os.stat
    wanted = os.path.realpath(path)

    def fake(p, *args, **kwargs):
        st = real(p, *args, **kwargs)
        if isinstance(p, str | os.PathLike) and os.path.realpath(p) == wanted:
            fields = list(st)
            fields[stat.ST_UID] = uid
            return os.stat_result(fields)
        return st

    monkeypatch.setattr(os, "stat", fake)


def test_a_checkpoint_dir_of_another_user_is_refused(tmp_path, monkeypatch):
    target = tmp_path / "theirs"
    target.mkdir(mode=0o755)
    me = os.geteuid()
    _owned_by(monkeypatch, target, me + 1000)
    with pytest.raises(CheckpointError, match=f"another user \\(uid {me + 1000}") as info:
        CheckpointStore(str(target))
    assert "directory you own" in str(info.value)


def test_a_root_owned_checkpoint_dir_is_accepted(tmp_path, monkeypatch):
    target = tmp_path / "roots"
    target.mkdir(mode=0o755)
    _owned_by(monkeypatch, target, 0)  # root can write anywhere: owning it adds nothing
    CheckpointStore(str(target)).save(_ckpt(1))
    assert _mode(target / "ckpt-000000000001.pt") == 0o600
