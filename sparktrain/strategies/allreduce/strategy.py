"""The barrier allreduce strategies: ``ring``, ``tree`` and ``auto``.

Every rank holds the whole model and averages gradients with the others each step
(:class:`~sparktrain.task.step_sync.AllreduceSync`: buckets, overlap with backward,
compression per bucket). ``ring`` is bandwidth-optimal (:mod:`sparktrain.wire.ring`),
``tree`` latency-optimal for small messages (:mod:`sparktrain.wire.tree`); ``auto``
probes the links at stage start and picks one of them and a compressor
(:mod:`sparktrain.task.probe`). They keep no driver-side services: a restart resumes
from the ranks' checkpoints.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sparktrain import costmodel
from sparktrain.errors import ConfigError
from sparktrain.strategies.base import Strategy
from sparktrain.strategies.registry import register

if TYPE_CHECKING:
    from torch import nn

    from sparktrain.config import TrainConfig
    from sparktrain.costmodel import CompressorCost
    from sparktrain.task.context import WorkerContext
    from sparktrain.task.step_sync import StepSync
    from sparktrain.wire import Mesh


class Allreduce(Strategy):
    """Gradients averaged by a collective between the barrier tasks."""

    per_layer_compression = True
    pipeline_replicas = True
    auto_compression = True
    supports_cuda = True
    compression_paths = True

    def worker_sync(self, ctx: WorkerContext, model: nn.Module, mesh: Mesh) -> StepSync:
        from sparktrain.task.step_sync import AllreduceSync

        if ctx.job.config.comm_backend == "torch":  # opt-in: torch.distributed's collectives
            from sparktrain.strategies.allreduce.task_torch import TorchSync

            return TorchSync(ctx, model, mesh)
        if ctx.job.config.shard_optimizer:  # ZeRO-1: the optimizer state in slices
            from sparktrain.task.sharded import ShardedSync

            return ShardedSync(ctx, model, mesh)
        return AllreduceSync(ctx, model, mesh)


class _FixedAllreduce(Allreduce):
    """Ring or tree as named: what only a fixed algorithm can do."""

    supports_run = True
    supports_torch_run = True
    supports_sharding = True
    torch_backend = True


class Ring(_FixedAllreduce):
    """Bandwidth-optimal ring allreduce (reduce-scatter + all-gather)."""

    name = "ring"
    cost_model = "ring"


class Tree(_FixedAllreduce):
    """Recursive-doubling tree allreduce, for small, latency-bound gradients."""

    name = "tree"
    cost_model = "tree"


class Auto(Allreduce):
    """Ring or tree and a compressor, chosen inside the stage from measured links."""

    name = "auto"
    pipeline_replicas = False

    def validate(self, cfg: TrainConfig) -> None:
        if cfg.parallelism_pipeline > 1:
            raise ConfigError(
                "strategy/compression 'auto' do not combine with parallelism.pipeline > 1: "
                "give strategy='ring' and a compression spec"
            )
        super().validate(cfg)

    def comm_s(
        self,
        nbytes: float,
        world: int,
        alpha: float,
        beta: float,
        *,
        compressor: CompressorCost | None = None,
        buckets: int = 1,
    ) -> float:
        """What the choice would predict: the faster of ring and tree."""
        return min(
            costmodel.comm_s(s, nbytes, world, alpha, beta, compressor=compressor, buckets=buckets)
            for s in costmodel.AUTO_STRATEGIES
        )


for _strategy in (Ring(), Tree(), Auto()):
    register(_strategy)
