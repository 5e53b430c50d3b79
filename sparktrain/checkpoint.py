"""Checkpoints through ``pyarrow.fs``: local paths and any filesystem URI pyarrow supports
(``file://``, ``hdfs://``, ``s3://``, ...) work alike.

A checkpoint is one file ``ckpt-<step>.pt`` holding tensors and plain values only (model
and optimizer state, step, RNG state, history as JSON text), written with ``torch.save``
and read back with ``torch.load(weights_only=True)``, so loading never runs pickled
code. State that differs per rank (error-feedback residuals, PowerSGD's ``Q``...) goes
to shard files next to it, ``ckpt-<step>.rank-<r>-of-<n>.pt``, one written by each
rank. Commit order: every rank writes its shard, rank 0 writes its shard and then the
main file, so a checkpoint counts as complete only when the main file and all ``n``
shards are present (a main file with no shard at all has no per-rank state). The newest
``keep`` complete checkpoints are kept; older files, shards included, are removed.

Durability. Each file is written under a temporary name ``.tmp-<hex>`` and renamed: a
reader sees a whole file or none. On a local disk (a plain path or ``file://``) the
file is fsynced before the rename and the directory after it, so a checkpoint that was
listed survives a power loss. Other filesystems give what their close and rename give:
on HDFS a closed file is complete on the datanodes and the rename is atomic in the
namenode; on object stores (S3, GCS, Azure) an object appears whole when its upload
completes and the "rename" is a copy then a delete. None of them is asked for an fsync
(pyarrow's output streams have none). Whatever the filesystem, :meth:`CheckpointStore.load`
without a step skips a checkpoint that cannot be read (truncated, corrupt, a shard
missing) and falls back to the newest intact one, saying so in the log.

Temporary files left by a killed writer are removed when older than
``ORPHAN_AGE_S`` (at every save), or all at once when a new run starts
(:meth:`CheckpointStore.remove_orphans`).

Permissions (local disk). Checkpoints hold the model and, on resume, are loaded as the
run's state, so only the user who runs the job may read or write them: files are
created ``0600`` and the directories sparktrain creates ``0700`` (an existing directory
keeps its mode). A directory that other users could write to is refused
(:func:`check_private_dir`): one that is world-writable, or that belongs to another user
(root excepted). Every process that writes checkpoints must therefore run as the same
user. Remote filesystems (HDFS, object stores) keep their own permission model.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import stat
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow.fs as pafs
import torch

from sparktrain.errors import CheckpointError, ConfigError

log = logging.getLogger(__name__)

_NAME = re.compile(r"^ckpt-(\d{12})\.pt$")
_SHARD = re.compile(r"^ckpt-(\d{12})\.rank-(\d{5})-of-(\d{5})\.pt$")
BEST_NAME = "best.pt"
"""Early stopping's best checkpoint: matches neither pattern above, so pruning keeps it."""
_TMP_PREFIX = ".tmp-"
ORPHAN_AGE_S = 3600.0
"""A temporary file older than this is taken for the leftover of a killed writer (no
checkpoint takes an hour to write) and removed by the next save."""
RANK_SHARDS = "rank_shards"
"""Key in :attr:`Checkpoint.extra`: how many per-rank shards belong to the checkpoint."""
PIPELINE_LAYOUT = "pipeline"
"""Key in :attr:`Checkpoint.extra` of a pipeline run's checkpoint: the layout it was
written with (``stages``, ``replicas``, layer ``bounds``); its model lives in the
stages' shards, not in the main file."""

SHARED_SCHEMES = ("hdfs://", "s3://", "gs://", "abfs://", "file://")
FILE_MODE = 0o600
"""Mode of the checkpoint files written on a local disk: the owner's alone."""
DIR_MODE = 0o700
"""Mode of the checkpoint directories sparktrain creates on a local disk."""
_SINGLE_HOST_MASTER = re.compile(r"^local(\[[^\]]*\])?$")


def open_for_run(uri: str, keep: int, *, resume: bool) -> CheckpointStore:
    """The checkpoint store of a new run.

    No writer of the directory can be alive yet, so temporary files a killed writer left
    are removed. A directory that already holds checkpoints is refused unless the run
    resumes: a restart would otherwise continue from an earlier run's newer checkpoint,
    and pruning would delete this run's own.
    """
    store = CheckpointStore(uri, keep)
    store.remove_orphans()
    newest = store.latest_step()
    if newest is not None and not resume:
        raise CheckpointError(
            f"checkpoint_dir {uri!r} already holds checkpoints of an earlier run (newest: "
            f"step {newest}); set resume=true to continue that run, or give an empty "
            "checkpoint_dir (or delete its ckpt-* files) to start a new one"
        )
    return store


def check_shared(uri: str, master: str) -> None:
    """Refuse a plain local path for ``checkpoint_dir`` when executors may run on other
    hosts than the driver (any master but ``local``/``local[...]``): every rank writes
    its shard there and every rank reads the checkpoint back after a restart, so the
    directory must be the same one for all of them. ``file://`` says explicitly that
    the path is on a disk every host shares (NFS, or one machine's local-cluster)."""
    if not uri or _SINGLE_HOST_MASTER.match(master.strip()):
        return
    if "://" in uri:
        return
    raise ConfigError(
        f"checkpoint_dir={uri!r} is a local path, but master {master!r} may run executors "
        "on other hosts, which would each write and read a different directory: use a "
        f"URI every host reaches ({', '.join(SHARED_SCHEMES[:-1])}), or "
        f"file://{os.path.abspath(uri)} if that path is on a disk every host shares"
    )


@dataclass
class Checkpoint:
    """What a worker needs to continue exactly where the run stopped."""

    step: int  # global optimizer steps completed
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any]
    rng_state: torch.Tensor
    history: list[dict[str, Any]]
    extra: dict[str, Any] = field(default_factory=dict)
    """Strategy-specific state (tensors and plain values only, e.g. a parameter server's
    versions and staleness bookkeeping)."""


class CheckpointStore:
    """Atomic save, newest-first listing and pruning in one directory (or URI)."""

    def __init__(self, uri: str, keep: int = 3) -> None:
        if keep < 1:
            raise CheckpointError(f"keep_checkpoints={keep} must be >= 1")
        self.uri = uri
        try:
            self._fs, self._dir = pafs.FileSystem.from_uri(uri)
        except (pafs.ArrowInvalid, ValueError, TypeError):  # a plain local path
            self._fs, self._dir = pafs.LocalFileSystem(), uri
        except OSError as exc:
            raise CheckpointError(f"checkpoint_dir {uri!r} cannot be opened: {exc}") from exc
        self._dir = self._dir.rstrip("/") or "/"
        self.keep = keep
        # a local disk is written with os calls: fsync before the rename, and of the dir
        self._local = isinstance(self._fs, pafs.LocalFileSystem)
        if self._local and os.path.isdir(self._dir):
            check_private_dir(self._dir, uri)

    def _path(self, name: str) -> str:
        return f"{self._dir}/{name}"

    @staticmethod
    def main_name(step: int) -> str:
        return f"ckpt-{step:012d}.pt"

    @staticmethod
    def shard_name(step: int, rank: int, world: int) -> str:
        return f"ckpt-{step:012d}.rank-{rank:05d}-of-{world:05d}.pt"

    # ------------------------------------------------------------------ listing

    def _list(self) -> list[pafs.FileInfo]:
        try:
            infos = self._fs.get_file_info(pafs.FileSelector(self._dir, allow_not_found=True))
        except OSError as exc:
            raise CheckpointError(f"cannot list checkpoint_dir {self.uri!r}: {exc}") from exc
        return [i for i in infos if i.type == pafs.FileType.File]

    def _scan(self) -> tuple[set[int], dict[int, set[tuple[int, int]]]]:
        """Steps with a main file, and per step the shards present as (rank, world)."""
        mains: set[int] = set()
        shards: dict[int, set[tuple[int, int]]] = {}
        for info in self._list():
            if match := _NAME.match(info.base_name):
                mains.add(int(match.group(1)))
            elif match := _SHARD.match(info.base_name):
                step, rank, world = (int(g) for g in match.groups())
                shards.setdefault(step, set()).add((rank, world))
        return mains, shards

    @staticmethod
    def _complete(step: int, shards: dict[int, set[tuple[int, int]]]) -> bool:
        have = shards.get(step)
        if not have:
            return True  # a checkpoint without per-rank state
        worlds = {w for _, w in have}
        return any(all((r, w) in have for r in range(w)) for w in worlds)

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints present (main file and every shard), oldest
        first."""
        mains, shards = self._scan()
        return sorted(s for s in mains if self._complete(s, shards))

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step (not read: see :meth:`newest_intact`)."""
        steps = self.steps()
        return steps[-1] if steps else None

    # ------------------------------------------------------------------ writing

    def _write(self, name: str, data: dict[str, Any]) -> str:
        """``torch.save`` ``data`` to ``name`` atomically (temporary name, then rename)."""
        buffer = io.BytesIO()
        torch.save(data, buffer)
        final = self._path(name)
        tmp = self._path(f"{_TMP_PREFIX}{uuid.uuid4().hex}")
        try:
            if self._local:
                # checked again now that it exists: another user may have made it first
                make_private_dirs(self._dir)
                check_private_dir(self._dir, self.uri)
                _write_local(tmp, final, buffer.getbuffer())
            else:
                self._fs.create_dir(self._dir, recursive=True)
                with self._fs.open_output_stream(tmp) as out:
                    out.write(buffer.getvalue())
                self._fs.move(tmp, final)
        except OSError as exc:
            with contextlib.suppress(OSError):
                self._fs.delete_file(tmp)
            raise CheckpointError(f"cannot write a checkpoint to {self.uri!r}: {exc}") from exc
        return final

    def save(self, ckpt: Checkpoint) -> str:
        """Write the main file atomically and prune old checkpoints. With per-rank state,
        every rank's shard (:meth:`save_shard`) goes first: this file is the commit."""
        final = self._write(self.main_name(ckpt.step), _main_record(ckpt))
        self.prune()
        return final

    def save_best(self, ckpt: Checkpoint) -> str:
        """Write ``ckpt`` as the run's best (early stopping's best epoch so far), over the
        previous best; never pruned, never resumed from (:meth:`load_best` reads it)."""
        return self._write(BEST_NAME, _main_record(ckpt))

    def load_best(self) -> Checkpoint | None:
        """The checkpoint :meth:`save_best` wrote last, or None."""
        try:
            missing = self._fs.get_file_info(self._path(BEST_NAME)).type == pafs.FileType.NotFound
        except OSError:
            return None
        if missing:
            return None
        return _checkpoint_of(self._read(BEST_NAME), self._path(BEST_NAME))

    def save_shard(self, step: int, rank: int, world: int, state: dict[str, Any]) -> str:
        """Write rank ``rank``'s own state for the checkpoint of ``step``."""
        if not 0 <= rank < world:
            raise CheckpointError(f"shard rank {rank} is outside a world of {world}")
        data = {"format": 1, "step": step, "rank": rank, "world": world, "state": state}
        return self._write(self.shard_name(step, rank, world), data)

    def prune(self) -> None:
        """Keep the newest ``keep`` complete checkpoints; remove older files (main files,
        shards, incomplete checkpoints) and temporary files older than ``ORPHAN_AGE_S``.
        Incomplete checkpoints newer than the kept ones stay: their shards may still be
        on their way. Best effort: the next save tries again."""
        mains, shards = self._scan()
        complete = sorted(s for s in mains if self._complete(s, shards))
        if complete:
            oldest_kept = complete[-min(self.keep, len(complete))]
            for info in self._list():
                match = _NAME.match(info.base_name) or _SHARD.match(info.base_name)
                if match and int(match.group(1)) < oldest_kept:
                    self._delete(info.path)
        self.remove_orphans(ORPHAN_AGE_S)

    def remove_orphans(self, older_than_s: float = 0.0) -> int:
        """Delete temporary files older than ``older_than_s`` seconds (0: all of them, as
        when a new run starts and no writer of this directory can be alive); returns how
        many went."""
        now = time.time()
        removed = 0
        for info in self._list():
            if not info.base_name.startswith(_TMP_PREFIX):
                continue
            mtime = info.mtime.timestamp() if info.mtime is not None else 0.0
            if older_than_s <= 0 or now - mtime > older_than_s:
                removed += self._delete(info.path)
        if removed:
            log.info("removed %d orphaned temporary file(s) from %s", removed, self.uri)
        return removed

    def _delete(self, path: str) -> int:
        try:
            self._fs.delete_file(path)
        except OSError:
            return 0
        return 1

    # ------------------------------------------------------------------ reading

    def _read(self, name: str) -> dict[str, Any]:
        path = self._path(name)
        try:
            with self._fs.open_input_file(path) as fh:
                raw = fh.read()
            data = torch.load(io.BytesIO(raw), weights_only=True)
        except OSError as exc:
            raise CheckpointError(f"cannot read checkpoint {path!r}: {exc}") from exc
        except Exception as exc:  # weights_only refuses anything but tensors and plain data
            raise CheckpointError(
                f"checkpoint {path!r} is not a sparktrain checkpoint or is corrupt ({exc}); "
                "delete it or point checkpoint_dir elsewhere"
            ) from exc
        if not isinstance(data, dict) or data.get("format") != 1:
            raise CheckpointError(f"checkpoint {path!r} has an unknown format")
        return data

    def _load_main(self, step: int) -> Checkpoint:
        return _checkpoint_of(self._read(self.main_name(step)), self._path(self.main_name(step)))

    def load_shard(self, step: int, rank: int, world: int) -> dict[str, Any]:
        """Rank ``rank``'s state saved with the checkpoint of ``step`` in a world of
        ``world`` ranks."""
        data = self._read(self.shard_name(step, rank, world))
        if (data.get("step"), data.get("rank"), data.get("world")) != (step, rank, world):
            raise CheckpointError(
                f"shard {self.shard_name(step, rank, world)!r} in {self.uri!r} holds "
                f"step {data.get('step')}, rank {data.get('rank')} of {data.get('world')}"
            )
        state = data.get("state")
        if not isinstance(state, dict):
            raise CheckpointError(f"shard {self.shard_name(step, rank, world)!r} has no state")
        return state

    def _candidates(self) -> Iterator[int]:
        yield from reversed(self.steps())

    def load(self, step: int | None = None) -> Checkpoint | None:
        """The checkpoint at ``step``, or None if there is none at all.

        Without ``step``: the newest *intact* one. A checkpoint that cannot be read
        (truncated, corrupt, a shard unreadable) is skipped with a warning and the next
        older one is tried; if none is intact, the newest one's error is raised."""
        if step is not None:
            return self._load_main(step)
        first_error: CheckpointError | None = None
        skipped: list[int] = []
        for candidate in self._candidates():
            try:
                ckpt = self._load_main(candidate)
                self._check_shards(ckpt)
            except CheckpointError as exc:
                log.warning("checkpoint of step %d is unusable: %s", candidate, exc)
                first_error = first_error or exc
                skipped.append(candidate)
                continue
            if skipped:
                log.warning(
                    "using the checkpoint of step %d, the newest intact one in %s "
                    "(skipped step(s) %s)",
                    candidate,
                    self.uri,
                    ", ".join(map(str, skipped)),
                )
            return ckpt
        if first_error is not None:
            raise first_error
        return None

    def newest_intact(self) -> int | None:
        """The step of the newest checkpoint that reads back whole, shards included (see
        :meth:`load`), or None if there is none."""
        ckpt = self.load()
        return None if ckpt is None else ckpt.step

    def _check_shards(self, ckpt: Checkpoint) -> None:
        """Every shard the checkpoint names reads back."""
        world = int(ckpt.extra.get(RANK_SHARDS, 0) or 0)
        for rank in range(world):
            self.load_shard(ckpt.step, rank, world)


def make_private_dirs(path: str) -> None:
    """Create ``path`` and its missing parents with mode :data:`DIR_MODE` (whatever the
    umask); directories that already exist are left as they are."""
    missing: list[str] = []
    current = os.path.abspath(path)
    while not os.path.isdir(current):
        missing.append(current)
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, DIR_MODE)
        except FileExistsError:
            continue  # another rank made it meanwhile: checked by check_private_dir
        os.chmod(directory, DIR_MODE)  # the umask may have taken bits off mkdir's mode


def check_private_dir(path: str, uri: str | None = None) -> None:
    """Refuse a local checkpoint directory that users other than this process's could
    write to: a world-writable one (sticky bit or not: others could still add a
    checkpoint that a resumed run would load), or one another user owns (root
    excepted, which can write anywhere anyway). Raises
    :class:`~sparktrain.errors.CheckpointError` saying what to do."""
    if os.name != "posix":
        return  # no POSIX owner and mode bits to go by
    shown = uri or path
    st = os.stat(path)  # follows a symlink: the directory written to is what counts
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        raise CheckpointError(
            f"checkpoint_dir {shown!r} belongs to another user (uid {st.st_uid}; this "
            f"process runs as uid {me}), who could replace or add the checkpoints a "
            "resumed run loads: point checkpoint_dir at a directory you own, or at a new "
            f"path (sparktrain creates it with mode {DIR_MODE:o})"
        )
    if st.st_mode & stat.S_IWOTH:
        raise CheckpointError(
            f"checkpoint_dir {shown!r} is world-writable (mode "
            f"{stat.S_IMODE(st.st_mode):o}): any local user could replace or add the "
            f"checkpoints a resumed run loads; run chmod o-w {path!r} or point "
            f"checkpoint_dir at a new path (sparktrain creates it with mode {DIR_MODE:o})"
        )


def _write_local(tmp: str, final: str, data: memoryview) -> None:
    """Write, fsync, rename, fsync the directory: the rename is durable only once the
    directory entry is on disk, and the data only once the file is. The file is
    created :data:`FILE_MODE`, so it is never readable by others, not even before the
    rename."""
    directory = os.path.dirname(final) or "."  # made by the caller (make_private_dirs)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    try:
        view = memoryview(data).cast("B")
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, final)
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _main_record(ckpt: Checkpoint) -> dict[str, Any]:
    return {
        "format": 1,
        "step": ckpt.step,
        "model": ckpt.model_state,
        "optimizer": ckpt.optimizer_state,
        "rng": ckpt.rng_state,
        "history": json.dumps(ckpt.history),
        "extra": ckpt.extra,
    }


def _checkpoint_of(data: dict[str, Any], path: str) -> Checkpoint:
    try:
        return Checkpoint(
            step=int(data["step"]),
            model_state=data["model"],
            optimizer_state=data["optimizer"],
            rng_state=data["rng"],
            history=json.loads(data["history"]),
            extra=data.get("extra", {}),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path!r} lacks {exc}; delete it") from exc
