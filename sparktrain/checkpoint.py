"""Checkpoints through ``pyarrow.fs``: local paths and any filesystem URI pyarrow supports
(``file://``, ``hdfs://``, ``s3://``, ...) work alike.

A checkpoint is one file ``ckpt-<step>.pt`` holding tensors and plain values only (model
and optimizer state, step, RNG state, history as JSON text), written with ``torch.save``
and read back with ``torch.load(weights_only=True)``, so loading never runs pickled
code. Each write goes to a temporary name first and is then renamed: a reader sees a
whole checkpoint or none. The newest ``keep`` checkpoints are kept.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

import pyarrow.fs as pafs
import torch

from sparktrain.errors import CheckpointError

_NAME = re.compile(r"^ckpt-(\d{12})\.pt$")


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

    def _path(self, name: str) -> str:
        return f"{self._dir}/{name}"

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints present, oldest first."""
        try:
            infos = self._fs.get_file_info(pafs.FileSelector(self._dir, allow_not_found=True))
        except OSError as exc:
            raise CheckpointError(f"cannot list checkpoint_dir {self.uri!r}: {exc}") from exc
        found = []
        for info in infos:
            match = _NAME.match(info.base_name)
            if match and info.type == pafs.FileType.File:
                found.append(int(match.group(1)))
        return sorted(found)

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def save(self, ckpt: Checkpoint) -> str:
        """Write atomically (temporary name, then rename) and prune old checkpoints."""
        buffer = io.BytesIO()
        torch.save(
            {
                "format": 1,
                "step": ckpt.step,
                "model": ckpt.model_state,
                "optimizer": ckpt.optimizer_state,
                "rng": ckpt.rng_state,
                "history": json.dumps(ckpt.history),
                "extra": ckpt.extra,
            },
            buffer,
        )
        final = self._path(f"ckpt-{ckpt.step:012d}.pt")
        tmp = self._path(f".tmp-{uuid.uuid4().hex}")
        try:
            self._fs.create_dir(self._dir, recursive=True)
            with self._fs.open_output_stream(tmp) as out:
                out.write(buffer.getvalue())
            self._fs.move(tmp, final)
        except OSError as exc:
            raise CheckpointError(f"cannot write a checkpoint to {self.uri!r}: {exc}") from exc
        for old in self.steps()[: -self.keep]:
            with contextlib.suppress(OSError):  # best effort; the next save tries again
                self._fs.delete_file(self._path(f"ckpt-{old:012d}.pt"))
        return final

    def load(self, step: int | None = None) -> Checkpoint | None:
        """The checkpoint at ``step`` (default: the newest), or None if there is none."""
        step = self.latest_step() if step is None else step
        if step is None:
            return None
        path = self._path(f"ckpt-{step:012d}.pt")
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
        return Checkpoint(
            step=int(data["step"]),
            model_state=data["model"],
            optimizer_state=data["optimizer"],
            rng_state=data["rng"],
            history=json.loads(data["history"]),
            extra=data.get("extra", {}),
        )
