"""Spill files: a partition's feature rows on local disk as Arrow IPC, memory-mapped.

A worker whose partition outgrows ``data_memory_mb`` writes its feature chunks, once,
to an Arrow IPC file and reads them back through a memory map: the operating system's
page cache then holds what fits and the worker's own (anonymous) memory stays flat.

Where: ``<local dir>/sparktrain-spill/<job id>/rank<R>-attempt<A>-pid<P>.arrow``, the
local dir being the application's folder that holds the executor's first
``SPARK_LOCAL_DIRS`` entry (under ``spark.local.dir`` or the cluster manager's local
dirs; see :func:`local_root`), else the system temp dir. The file is
removed when the task's partition is closed, on success and on failure alike. A worker
killed outright leaves its file behind: every task sweeps, before it spills, the files
whose process is gone (and their empty job directories), so orphans last until the next
task on that host. A restarted stage is a new attempt and spills again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from sparktrain.data.features import Features

log = logging.getLogger(__name__)

SPILL_DIR_NAME = "sparktrain-spill"
_FILE = re.compile(r"^rank\d+-attempt\d+-pid(?P<pid>\d+)(-c\d+)?\.arrow(\.part)?$")
_SCHEMA_FIELD = "features"


def local_root() -> Path:
    """Where spill folders go: the executor's first local dir (``SPARK_LOCAL_DIRS``), else
    the temp dir. Spark hands Python workers their executor's ``blockmgr-*`` folder; its
    parent, the application's folder on that host, is shared by the application's
    executors there, so a task also sweeps what an executor killed before it left."""
    dirs = [d.strip() for d in os.environ.get("SPARK_LOCAL_DIRS", "").split(",") if d.strip()]
    if not dirs:
        return Path(tempfile.gettempdir())
    first = Path(dirs[0])
    return first.parent if first.name.startswith("blockmgr-") else first


def spill_path(job_id: str, rank: int, attempt: int, root: Path | None = None) -> Path:
    """This task's spill file (made, with its directory, only if the task spills); a
    partition of several columns spills each to :func:`column_path` of it."""
    safe_job = re.sub(r"[^A-Za-z0-9_.-]", "_", job_id) or "job"
    folder = (root or local_root()) / SPILL_DIR_NAME / safe_job
    return folder / f"rank{rank}-attempt{attempt}-pid{os.getpid()}.arrow"


def column_path(path: Path, index: int) -> Path:
    """The spill file of input column ``index`` (the first keeps ``path`` itself)."""
    return path if index == 0 else path.with_name(f"{path.stem}-c{index}{path.suffix}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def sweep_orphans(root: Path | None = None) -> list[Path]:
    """Remove spill files whose process is gone, and job directories left empty; the
    removed files. Files of live processes (other tasks, other applications) stay."""
    base = (root or local_root()) / SPILL_DIR_NAME
    removed: list[Path] = []
    if not base.is_dir():
        return removed
    for job_dir in base.iterdir():
        if not job_dir.is_dir():
            continue
        for path in job_dir.iterdir():
            match = _FILE.match(path.name)
            if match is None or _alive(int(match["pid"])):
                continue
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed.append(path)
        with contextlib.suppress(OSError):  # not empty, or removed by another task
            job_dir.rmdir()
    if removed:
        log.info("removed %d spill file(s) left by killed workers under %s", len(removed), base)
    return removed


def _create(path: Path) -> pa.NativeFile:
    """Open a new file, making its directory: another task's sweep may remove the
    directory while it is still empty, so try again a few times."""
    for attempt in range(3):
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            return pa.OSFile(str(path), "wb")
        except FileNotFoundError:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def arrow_type(dtype: np.dtype[Any]) -> pa.DataType:
    return pa.from_numpy_dtype(dtype)


class IpcSpillFile:
    """One column's spill file: chunks appended as record batches of one field to
    ``<name>.part``, renamed to ``<name>`` when complete and memory-mapped back;
    :meth:`abort` (or a failure while mapping) removes what was written."""

    def __init__(self, path: Path, field_type: pa.DataType) -> None:
        self.path = path
        self._part = path.with_name(path.name + ".part")
        self._sink = _create(self._part)
        self._writer = pa.ipc.new_file(self._sink, pa.schema([(_SCHEMA_FIELD, field_type)]))

    def _write_array(self, array: pa.Array) -> None:
        self._writer.write_batch(pa.RecordBatch.from_arrays([array], [_SCHEMA_FIELD]))

    def _close_and_map(self) -> tuple[pa.MemoryMappedFile, list[pa.Array]]:
        """Complete the file and map it: the map and its non-empty chunks (zero-copy)."""
        self._writer.close()
        self._sink.close()
        self._part.rename(self.path)
        source = pa.memory_map(str(self.path), "r")
        reader = pa.ipc.open_file(source)
        columns = [reader.get_batch(i).column(0) for i in range(reader.num_record_batches)]
        return source, [c for c in columns if len(c)]

    def _release(self, source: pa.MemoryMappedFile) -> Callable[[], None]:
        """What closes the mapped store: unmap, remove the file and, when it is the last
        one, its job folder."""

        def release() -> None:
            source.close()
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            with contextlib.suppress(OSError):  # other ranks' files may still be there
                self.path.parent.rmdir()

        return release

    def abort(self) -> None:
        """Drop the partial file (after a failure while ingesting)."""
        with contextlib.suppress(Exception):
            self._writer.close()
        with contextlib.suppress(Exception):
            self._sink.close()
        for p in (self._part, self.path):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()


class SpillWriter(IpcSpillFile):
    """Appends ``(n, width)`` chunks of one dtype to an Arrow IPC file, then maps it back
    as :class:`Features`."""

    def __init__(self, path: Path, width: int, dtype: Any = np.float32) -> None:
        self.width = width
        self.dtype = np.dtype(dtype)
        super().__init__(path, pa.list_(arrow_type(self.dtype), width))
        self.rows = 0

    def write(self, chunk: np.ndarray) -> None:
        """Append ``(n, width)`` rows."""
        if not len(chunk):
            return
        flat = pa.array(np.ascontiguousarray(chunk, self.dtype).reshape(-1))
        self._write_array(pa.FixedSizeListArray.from_arrays(flat, self.width))
        self.rows += len(chunk)

    def finish(self) -> Features:
        """Close the file and map it: every chunk a zero-copy view of the map."""
        try:
            source, columns = self._close_and_map()
            whole = source.read_buffer(source.size())
            chunks, firsts = [], []
            itemsize = self.dtype.itemsize
            for column in columns:
                child = column.values  # the values, without the list's offset
                values = column.flatten().to_numpy(zero_copy_only=True)
                chunks.append(values.reshape(len(column), self.width))
                data = child.buffers()[1]
                first = (data.address - whole.address) // itemsize + child.offset
                firsts.append(first + column.offset * self.width)
            flat = np.frombuffer(whole, self.dtype, count=whole.size // itemsize)
            windows = np.lib.stride_tricks.sliding_window_view(flat, self.width)
        except BaseException:
            self.abort()
            raise
        return Features(
            chunks,
            self.width,
            on_close=self._release(source),
            spilled_bytes=self.path.stat().st_size,
            flat=(windows, np.asarray(firsts, np.int64)),
            dtype=self.dtype,
        )
