"""``comm_backend = "torch"``: the ring/tree gradient averaging through
``torch.distributed``: Gloo on the CPU, NCCL for a model on a CUDA device.

The buckets are host memory whatever the model's device (the wire of the sparktrain
backend reads them), and NCCL reduces only CUDA tensors: under NCCL each bucket is
copied to the task's GPU, reduced there and copied back. Those two copies over PCIe are
what NCCL's transport (NVLink, InfiniBand) costs here against Gloo's TCP.

Everything but the collective is :class:`~sparktrain.task.step_sync.AllreduceSync`'s:
the same buckets, the same weighting by row counts (each rank's gradients times its
rows, summed, divided by the summed rows, which travel in the bucket's count slot or
as a one-element allreduce of their own), the same overlap thread. Only the two
collectives change: the plain sum becomes ``dist.all_reduce`` and a compressed bucket
goes through torch's own DDP communication hook for its spec (``fp16``/``bf16``:
``default_hooks``; ``powersgd``: ``powerSGD_hook``), called on a stand-in for DDP's
``GradBucket`` (which Python cannot build).

The process group starts from sparktrain's authenticated rendezvous: rank 0 opens a
``TCPStore`` on its own task address (only there: torch alone would bind every
interface) and the port reaches the other ranks through the
authenticated all-gather. torch's store and collectives themselves are neither
authenticated nor encrypted (docs/security.md), hence opt-in.
"""

from __future__ import annotations

import datetime
import json
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from sparktrain.comm_backend import HookSpec, bound_store, hook_spec
from sparktrain.errors import CommError, ConfigError
from sparktrain.sparse.rows import sparse_parameters
from sparktrain.task.buckets import NONE
from sparktrain.task.context import WorkerContext
from sparktrain.task.step_sync import AllreduceSync
from sparktrain.wire import Mesh

log = logging.getLogger(__name__)


def collective_device(model_device: torch.device, nccl: bool) -> torch.device | None:
    """Where the collectives run: the model's CUDA device when NCCL is there (``nccl``:
    ``dist.is_nccl_available()``), else ``None``, the host buckets themselves (Gloo)."""
    return model_device if model_device.type == "cuda" and nccl else None


def init_process_group(ctx: WorkerContext, device: torch.device | None, timeout_s: float) -> str:
    """Start torch's default process group for this task from the authenticated
    rendezvous; returns the backend (``nccl`` for a collective device, else ``gloo``).

    The store listens on rank 0's own task address only (never a wildcard:
    :func:`~sparktrain.comm_backend.bound_store`) on a port the OS picks; the port goes
    out through ``ctx.all_gather``."""
    if dist.is_initialized():
        raise CommError(
            "comm_backend='torch': a torch.distributed process group is already running in "
            "this task (a train_fn's own?); destroy it first or use comm_backend='sparktrain'"
        )
    timeout = datetime.timedelta(seconds=timeout_s)
    store: dist.TCPStore | None = None
    port = 0
    if ctx.rank == 0:
        store = bound_store(ctx.host, ctx.world_size, timeout)
        port = store.port
    peers = [json.loads(s) for s in ctx.all_gather(json.dumps({"port": port, "host": ctx.host}))]
    if store is None:
        store = dist.TCPStore(
            peers[0]["host"], peers[0]["port"], ctx.world_size, is_master=False, timeout=timeout
        )
    backend = "nccl" if device is not None else "gloo"
    dist.init_process_group(
        backend, store=store, rank=ctx.rank, world_size=ctx.world_size, timeout=timeout
    )
    return backend


class TorchSumAllreduce:
    """The plain bucket's sum: ``dist.all_reduce`` on the bucket's own memory, or on a
    copy on ``device`` (NCCL's GPU) that is copied back."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device

    def allreduce_(self, buf: np.ndarray) -> None:
        host = torch.from_numpy(buf)
        if self.device is None:
            dist.all_reduce(host)
            return
        work = host.to(self.device, copy=True)
        dist.all_reduce(work)
        host.copy_(work)


class _HookBucket:
    """What a DDP communication hook reads of ``dist.GradBucket``: the flat buffer,
    per-parameter views of it, its index and whether it closes the step."""

    def __init__(
        self, index: int, buffer: torch.Tensor, shapes: Sequence[tuple[int, ...]], last: bool
    ):
        self._index, self._buffer, self._last = index, buffer, last
        views, offset = [], 0
        for shape in shapes:
            n = int(np.prod(shape)) if shape else 1
            views.append(buffer[offset : offset + n].view(shape))
            offset += n
        self._views = views

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return self._views

    def parameters(self) -> list[torch.Tensor]:
        return []

    def is_last(self) -> bool:
        return self._last

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer.copy_(tensor)


class HookReducer:
    """One compression spec's buckets through torch's DDP communication hook for it.

    A hook returns the mean over the world; times the world size that is the sum the
    bucket protocol wants (the buckets carry gradients times rows)."""

    def __init__(
        self, spec: HookSpec, last_index: int, seed: int, device: torch.device | None = None
    ) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        self.spec, self.last_index, self.device = spec, last_index, device
        self.state: Any = None
        if spec.hook == "powersgd":
            self.state = powerSGD_hook.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=spec.rank,
                start_powerSGD_iter=2,  # torch's minimum with error feedback or warm start
                min_compression_rate=2,
                use_error_feedback=spec.error_feedback,
                warm_start=spec.warm_start,
                random_seed=seed,
            )
            self.hook: Any = powerSGD_hook.powerSGD_hook
        else:
            self.hook = getattr(default_hooks, f"{spec.hook}_compress_hook")
        self.path = f"torch:{self.hook.__name__}"

    def reduce_(
        self,
        index: int,
        grads: torch.Tensor,
        count: float | None,
        *,
        shapes: Sequence[tuple[int, ...]] = (),
        raw_length: int | None = None,
    ) -> float:
        # under NCCL the hook works on a copy on the GPU; copy_ brings the mean back
        work = grads if self.device is None else grads.to(self.device, copy=True)
        bucket = _HookBucket(index, work, shapes or [tuple(grads.shape)], index == self.last_index)
        mean = self.hook(self.state, bucket).wait()
        grads.copy_(mean).mul_(dist.get_world_size())
        if count is None:
            return float("nan")  # only the first bucket's total is read
        total = torch.tensor([count], dtype=torch.float64, device=self.device)
        dist.all_reduce(total)
        return float(total.item())

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


class TorchSync(AllreduceSync):
    """:class:`AllreduceSync` whose collectives are ``torch.distributed``'s."""

    def __init__(self, ctx: WorkerContext, model: nn.Module, mesh: Mesh) -> None:
        cfg = ctx.job.config
        if cfg.sparse_embeddings == "auto" and sparse_parameters(model):
            # the row path is sparktrain's allgather: not built on torch.distributed
            raise ConfigError(
                "comm_backend='torch' does not exchange the rows of sparse=True embedding "
                "tables: set sparse_embeddings='off' (the tables go dense) or use "
                "comm_backend='sparktrain'"
            )
        param = next(model.parameters(), None)
        model_device = param.device if param is not None else torch.device("cpu")
        device = collective_device(model_device, dist.is_nccl_available())
        self.backend = init_process_group(ctx, device, cfg.comm_timeout)
        try:
            super().__init__(ctx, model, mesh)
            self._plain = TorchSumAllreduce(device)  # type: ignore[assignment]
            specs = self.buckets.specs
            hooks: dict[str, HookReducer] = {}
            for spec in dict.fromkeys(specs):
                parsed = hook_spec(spec) if spec != NONE else None
                if parsed is not None:
                    last = max(i for i, s in enumerate(specs) if s == spec)
                    hooks[spec] = HookReducer(parsed, last, cfg.seed, device)
            self.reducers = hooks  # type: ignore[assignment]
            self._per_bucket = [hooks.get(s) for s in specs]  # type: ignore[misc]
        except BaseException:
            dist.destroy_process_group()
            raise

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "comm_backend": f"torch:{self.backend}"}

    def rank_state(self) -> dict[str, Any] | None:
        """None: torch's hook state (PowerSGD's error and warm-start factors) is not
        checkpointed; a restarted stage starts it afresh."""
        return None

    def load_rank_state(self, state: dict[str, Any]) -> None:
        log.info("comm_backend='torch' keeps no compressor state: a checkpoint's is ignored")

    def close(self) -> None:
        """Stop the overlap thread, then destroy the process group (the reused Python
        worker's next task starts its own)."""
        super().close()
        if dist.is_initialized():
            dist.destroy_process_group()
