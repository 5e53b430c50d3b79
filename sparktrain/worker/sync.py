"""How a rank turns its gradients into the next parameters: one small protocol, one
class per strategy, chosen by name.

- ``ring`` / ``tree``: average gradients with an allreduce (``buckets.py`` for the
  weighting rule), then every rank takes the same optimizer step. With
  ``config.compression`` set, buckets go through ``sparktrain.compress.collective``.
- ``ps``: push gradients to the parameter server in the driver, pull parameters back
  (``sparktrain.ps``).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from sparktrain.comm import Mesh, RingAllreduce, TreeAllreduce, make_allreduce
from sparktrain.compress.base import build as build_compressor
from sparktrain.compress.collective import CompressedAllreduce
from sparktrain.errors import ConfigError
from sparktrain.modeling import build_optimizer
from sparktrain.worker.buckets import GradientBuckets
from sparktrain.worker.context import WorkerContext


class StepSync(Protocol):
    """Called once per step after ``backward()``; leaves the next parameters in the model
    and zeroed gradients behind."""

    def step(self, count: int) -> None:
        """``count`` = samples behind this rank's gradients in this step (0 = none)."""

    def stats(self) -> dict[str, Any]:
        """Strategy-specific figures for the summary (JSON-able)."""

    def close(self) -> None:
        """Release sockets and threads; idempotent."""

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The rank-local optimizer whose state checkpoints hold; None when the optimizer
        lives elsewhere (the parameter server)."""


class AllreduceSync:
    """Sample-weighted gradient averaging by ring or tree allreduce, then a local step."""

    def __init__(self, ctx: WorkerContext, model: nn.Module, mesh: Mesh) -> None:
        cfg = ctx.job.config
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(cfg.optimizer, params, cfg.lr, dict(cfg.optimizer_kwargs))
        self.buckets = GradientBuckets(params, int(cfg.bucket_mb * (1 << 20)))
        self.allreduce = make_allreduce(cfg.strategy, mesh)
        self.compressed: CompressedAllreduce | None = None
        comp = build_compressor(cfg.compression)
        if comp is not None:
            algo = self.allreduce
            assert isinstance(algo, RingAllreduce | TreeAllreduce)
            self.compressed = CompressedAllreduce(comp, algo, seed=cfg.seed)

    def step(self, count: int) -> None:
        if self.compressed is not None:
            self.buckets.average_compressed_(self.compressed, count)
        else:
            self.buckets.average_(self.allreduce, count)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"gradient_elements": self.buckets.num_elements}
        if self.compressed is not None:
            out["compression_path"] = self.compressed.path
        return out

    def close(self) -> None:
        pass


def make_sync(ctx: WorkerContext, model: nn.Module, mesh: Mesh) -> StepSync:
    """The StepSync for ``config.strategy``."""
    strategy = ctx.job.config.strategy
    if strategy in ("ring", "tree"):
        return AllreduceSync(ctx, model, mesh)
    if strategy == "ps":
        from sparktrain.ps.client import ParameterServerSync

        return ParameterServerSync(ctx, model, mesh)
    raise ConfigError(f"strategy {strategy!r} does not run in a barrier stage")
