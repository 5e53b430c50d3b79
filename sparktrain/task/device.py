"""Which device a task trains on: the config's ``device`` and the GPUs Spark gave the task.

Spark hands a task the addresses of its GPUs (``TaskContext.resources()["gpu"]``; the
launcher puts them in :attr:`~sparktrain.task.context.WorkerContext.gpus`). A task
pins itself to the first one. ``device="auto"`` takes CUDA only when the task was given
a GPU *and* CUDA works in its process, so CPU clusters (and a fake discovery script in
tests) keep training on the CPU; ``device="cuda"`` without both is an error, raised by
every rank before it opens a socket, so no rank waits for a peer that already failed.

Pure functions of their inputs besides :func:`place`, so unit tests cover every branch
without a GPU.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sparktrain.errors import ResourceError

if TYPE_CHECKING:
    from sparktrain.config import TrainConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Placement:
    """Where a task trains and why; its figures go into the run summary's stats."""

    device: torch.device
    gpus: tuple[str, ...]  # the addresses Spark assigned the task
    gpu: str | None  # the address the task pinned itself to (None on the CPU)
    reason: str

    def stats(self) -> dict[str, object]:
        """The placement as the summary's per-rank figures."""
        return {"device": str(self.device), "gpus": list(self.gpus), "gpu": self.gpu}


def device_for(cfg: TrainConfig) -> str:
    """The device the task may use: the config's, or ``"cpu"`` where the strategy has
    no GPU path (``"auto"`` falls back; the config refuses ``"cuda"`` there)."""
    from sparktrain.strategies import registry

    # the strategy's own answer (Strategy.supports_cuda); pipelines train on the CPU
    if registry.get(cfg.strategy).supports_cuda and cfg.parallelism_pipeline == 1:
        return cfg.device
    return "cpu"


def cuda_index(address: str, visible: str | None, count: int) -> int:
    """The CUDA ordinal of Spark's GPU ``address`` in this process.

    Spark's addresses are what the discovery script reported, normally physical ids.
    When the cluster manager already narrowed ``CUDA_VISIBLE_DEVICES`` (YARN, Kubernetes
    isolation), ordinals count the visible devices only: the address's position in that
    list, or ordinal 0 when the one visible device is the task's own.
    """
    if visible is not None and visible.strip():
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        if address in ids:
            return ids.index(address)
        if len(ids) == 1 or count == 1:
            return 0
        raise ResourceError(
            f"Spark assigned GPU {address!r} but CUDA_VISIBLE_DEVICES={visible!r} does not "
            "list it: make the discovery script report the ids CUDA_VISIBLE_DEVICES uses"
        )
    try:
        index = int(address)
    except ValueError:
        raise ResourceError(
            f"Spark assigned GPU address {address!r}, which is not a CUDA ordinal: make "
            "the discovery script report integer ids (as nvidia-smi's index)"
        ) from None
    if not 0 <= index < count:
        raise ResourceError(
            f"Spark assigned GPU {address!r} but this process sees {count} CUDA device(s): "
            "check spark.worker.resource.gpu.discoveryScript and CUDA_VISIBLE_DEVICES"
        )
    return index


def resolve(
    requested: str,
    gpus: Sequence[str],
    *,
    cuda_available: bool,
    device_count: int = 0,
    visible: str | None = None,
) -> Placement:
    """Decide the placement for ``device=requested`` on a task given ``gpus``.

    Raises :class:`ResourceError` for ``"cuda"`` without a GPU address or without CUDA.
    """
    gpus = tuple(gpus)
    if requested == "cpu":
        return Placement(torch.device("cpu"), gpus, None, "device='cpu'")
    if requested not in ("auto", "cuda"):
        raise ResourceError(f"device={requested!r}: use 'auto', 'cpu' or 'cuda'")
    if not gpus or not cuda_available:
        if requested == "auto":
            why = "no GPU assigned to the task" if not gpus else "CUDA is not available"
            return Placement(torch.device("cpu"), gpus, None, f"device='auto': {why}")
        if not gpus:
            raise ResourceError(
                "device='cuda' but Spark assigned this task no GPU: set gpus_per_task=1 "
                "(or spark.task.resource.gpu.amount) on executors that have GPUs "
                "(spark.executor.resource.gpu.amount), or use device='auto'; local[N] "
                "masters assign tasks no GPUs: use local-cluster[...] with a worker "
                "discovery script on one machine (docs/gpu.md)"
            )
        raise ResourceError(
            f"device='cuda' but CUDA is not available in the task's process although "
            f"Spark assigned it GPU {gpus[0]!r} (torch {torch.__version__}, "
            f"CUDA build {torch.version.cuda or 'none'}): install a CUDA build of torch on "
            "the executors, or use device='auto'"
        )
    index = cuda_index(gpus[0], visible, device_count)
    return Placement(torch.device("cuda", index), gpus, gpus[0], f"device={requested!r}")


def place(requested: str, gpus: Sequence[str]) -> Placement:
    """:func:`resolve` for this process, then pin CUDA to the chosen device (so
    ``torch.device("cuda")`` and new streams mean the task's own GPU)."""
    available = torch.cuda.is_available()
    placement = resolve(
        requested,
        gpus,
        cuda_available=available,
        device_count=torch.cuda.device_count() if available else 0,
        visible=os.environ.get("CUDA_VISIBLE_DEVICES"),
    )
    if placement.device.type == "cuda":
        torch.cuda.set_device(placement.device)
    log.info("placement: %s (%s; task GPUs %s)", placement.device, placement.reason, gpus)
    return placement
