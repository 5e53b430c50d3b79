"""The two halves of a strategy.

The **driver half** runs on the driver (or the Spark Connect client): it validates the
strategy's own options, says how the strategy launches (:attr:`Strategy.launcher`),
starts and stops its driver-side services and says where a restarted stage resumes
(:meth:`Strategy.driver` returns a :class:`DriverHalf`). The **worker half** runs in
every task: :meth:`Strategy.worker_sync` builds the rank's
:class:`~sparktrain.task.step_sync.StepSync`. :meth:`Strategy.comm_s` gives the cost model
its per-step term.

A strategy object travels to the executors inside the job's
:class:`~sparktrain.task.context.JobSpec`, pickled by reference to its class: it
holds no state, and its module imports no pyspark at module level.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from sparktrain import costmodel
from sparktrain.compress.registry import split_spec
from sparktrain.errors import ConfigError

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from torch import nn

    from sparktrain.config import TrainConfig
    from sparktrain.costmodel import CompressorCost
    from sparktrain.driver.stage_runner import DriverJob, FitJob
    from sparktrain.result import TrainResult
    from sparktrain.task.context import JobSpec, WorkerContext
    from sparktrain.task.step_sync import StepSync
    from sparktrain.wire import Mesh


def loop_knobs(cfg: TrainConfig) -> dict[str, Any]:
    """The loop options of ``cfg`` that differ from their defaults, by config key."""
    defaults: dict[str, Any] = {
        "lr_schedule": "none",
        "warmup_steps": 0,
        "precision": "fp32",
        "accumulate_steps": 1,
        "clip_grad_norm": 0.0,
        "early_stopping": {},
        "metrics": [],
    }
    return {k: getattr(cfg, k) for k, v in defaults.items() if getattr(cfg, k) != v}


def refuse_loop_options(cfg: TrainConfig, knobs: Mapping[str, Any], where: str, hint: str) -> None:
    """A clear error naming the loop options ``where`` does not run with."""
    if knobs:
        listed = ", ".join(f"{k}={v!r}" for k, v in knobs.items())
        raise ConfigError(f"{where} does not run with {listed}: {hint}")


class DriverHalf:
    """A strategy's driver-side services for one job, across all its attempts.

    The stage runner calls :meth:`job_spec` once, then :meth:`begin_attempt` before every
    attempt and :meth:`resume_after_failure` after a failed one, :meth:`stop` when the
    stage is over (also on failure) and :meth:`finish` with the assembled result. This
    base class has no services and resumes from the run's checkpoint store.
    """

    def __init__(self, job: DriverJob) -> None:
        self.job = job

    def job_spec(self, spec: JobSpec) -> JobSpec:
        """The spec every attempt starts from (e.g. with the services' addresses)."""
        return spec

    def first_resume(self) -> tuple[int | None, tuple[dict[str, Any], ...]]:
        """(step, history) the first attempt resumes from; (None, ()) = from scratch."""
        from sparktrain.driver.stage_runner import resume_step

        return resume_step(self.job.store, self.job.config.resume), ()

    def begin_attempt(self, attempt: int) -> None:
        """Before attempt ``attempt`` (0, 1, ...) is launched."""

    def resume_after_failure(self) -> tuple[int | None, tuple[dict[str, Any], ...]]:
        """(step, history) the next attempt resumes from after a failed one."""
        from sparktrain.driver.stage_runner import resume_step

        return resume_step(self.job.store, True), ()

    def resume_source(self, step: int | None) -> str:
        """Where a resubmitted stage continues from, for the log."""
        if step is not None:
            return f"from the checkpoint of step {step}"
        hint = "" if self.job.store is not None else " (set checkpoint_dir to keep progress)"
        return "from scratch: no checkpoint to resume from" + hint

    def stop(self) -> None:
        """Stop every service; idempotent."""

    def finish(self, result: TrainResult) -> None:
        """Add the strategy's own figures to ``result`` (after :meth:`stop`)."""


class Strategy:
    """A gradient-aggregation strategy: subclass, set :attr:`name`, implement
    :meth:`worker_sync` (barrier strategies) and :func:`~sparktrain.strategies.register`
    an instance."""

    name: ClassVar[str]
    launcher: ClassVar[Literal["barrier", "rounds"]] = "barrier"
    """``barrier``: one barrier stage run by :mod:`sparktrain.driver.stage_runner` (needs a free
    slot per worker); ``rounds``: ordinary Spark jobs, see :meth:`launch`."""
    per_layer_compression: ClassVar[bool] = False
    """Does ``compression`` take a per-layer table (gradients bucketed by layer)?"""
    takes_delta: ClassVar[bool] = False
    """Does a ``delta+`` spec make sense (repeated sends of a value the receiver holds)?"""
    executors_write_checkpoints: ClassVar[bool] = True
    """Do the ranks write the checkpoints (then ``checkpoint_dir`` must be shared storage
    on a cluster), or the driver half (False)?"""
    pipeline_replicas: ClassVar[bool] = False
    """Can the replicas of a pipeline stage average their gradients with it?"""
    auto_compression: ClassVar[bool] = False
    """Can ``compression="auto"`` be chosen inside its stage (the link probe)?"""
    cost_model: ClassVar[str | None] = None
    """Its exchange in :func:`sparktrain.costmodel.comm_s` (``ring``, ``tree``, ``ps``)."""
    supports_run: ClassVar[bool] = False
    """Can ``sparktrain.run(train_fn)`` train with it (the user's own loop on its
    barrier stage)?"""
    supports_torch_run: ClassVar[bool] = False
    """Can ``sparktrain.torch_run(fn)`` meet its ranks over it (a mesh and nothing the
    function would have to serve)?"""
    supports_cuda: ClassVar[bool] = False
    """Does its exchange read gradients from device memory (``device="cuda"``)?"""
    supports_sharding: ClassVar[bool] = False
    """Can it shard the optimizer state (``shard_optimizer=true``: reduce-scatter,
    step a shard, all-gather)?"""
    torch_backend: ClassVar[bool] = False
    """Can ``comm_backend="torch"`` (torch.distributed with DDP's comm hooks) do its
    exchange?"""
    compression_paths: ClassVar[bool] = False
    """Does its allreduce choose how compressed buckets move (``compression_path``)?"""
    driver_service: ClassVar[str | None] = None
    """What the driver serves the ranks beyond progress, rendezvous and state, in words
    for the log (``"parameter server"``); None for nothing."""

    # ----------------------------------------------------------------- driver half
    def validate(self, cfg: TrainConfig) -> None:
        """Refuse options this strategy cannot run with, saying what to do instead.
        The base class checks the compression spec against the class attributes."""
        self._check_abilities(cfg)
        if cfg.parallelism_pipeline > 1 and cfg.compression == "auto":
            raise ConfigError(  # strategy='auto' is refused before (Auto.validate)
                "compression='auto' and parallelism.pipeline > 1 do not combine (the link "
                "probe picks a compressor for data parallelism): give a spec, e.g. "
                "compression='int8+ef', or compression='none'"
            )
        if cfg.compression == "auto" and not self.auto_compression:
            raise ConfigError(
                f"compression='auto' is chosen inside the barrier stage for the ring or tree "
                f"allreduce; with strategy={self.name!r} give a compressor (e.g. 'fp16', "
                "'topk:0.01+ef') or 'none', or use strategy='auto'"
            )
        table = isinstance(cfg.compression, Mapping)
        if table and not (self.per_layer_compression and cfg.parallelism_pipeline <= 1):
            raise ConfigError(
                "compression is a per-layer table, which only strategy='ring' or 'tree' (without "
                f"a pipeline) accepts; strategy={self.name!r} compresses whole parameter shards "
                "or payloads, not layers: give one spec string, e.g. compression='int8+ef'"
            )
        compression = cfg.compression
        specs = list(compression.values()) if isinstance(compression, Mapping) else [compression]
        for spec in specs:
            if spec != "auto" and split_spec(spec).delta and not self.takes_delta:
                raise ConfigError(
                    f"compression={spec!r}: delta encodes repeated sends of a value the "
                    "receiver already holds (parameter-server pulls, tree_aggregate's weight "
                    f"downloads); {self.name} exchanges fresh gradients, so drop 'delta+' "
                    "(e.g. use 'int8+ef')"
                )
        if cfg.compression_path != "auto":
            _check_compression_path(cfg, self.name, specs)
        if not cfg.drop_last and any(
            split_spec(s).base.partition(":")[0] == "sign" for s in specs if s != "auto"
        ):
            # measured, not a rule: digits CNN at a global batch of 64, one seed in three
            # collapses to 10 % on its epochs' 1-2 sample final steps; drop_last keeps it
            log.warning(
                "compression 'sign' with drop_last=false: a partition's short final batch "
                "(a sample or two) can make sign's error feedback diverge; set "
                "drop_last=true (docs/compression.md)"
            )
        if cfg.parallelism_pipeline > 1 and not self.pipeline_replicas:
            raise ConfigError(
                f"strategy={cfg.strategy!r} does not combine with parallelism.pipeline > 1: the "
                "replicas of a stage average gradients with the ring; use strategy='ring'"
            )
        if self.launcher == "rounds":
            refuse_loop_options(
                cfg,
                loop_knobs(cfg),
                f"strategy={self.name!r}",
                "use strategy='ring', 'tree' or 'ps' (data parallel) for them",
            )
        elif cfg.parallelism_pipeline > 1:
            refuse_loop_options(
                cfg,
                loop_knobs(cfg),
                "pipeline parallelism",
                "set parallelism.pipeline=1 (data parallel) for them",
            )

    def _check_abilities(self, cfg: TrainConfig) -> None:
        """Refuse the settings that need an ability this strategy has not declared."""
        from sparktrain.strategies import registry

        pipeline = cfg.parallelism_pipeline > 1
        if cfg.device == "cuda" and (not self.supports_cuda or pipeline):
            raise ConfigError(
                f"device='cuda' trains with strategy="
                f"{registry.spelled(registry.having('supports_cuda'))} without a pipeline; "
                f"strategy={self.name!r} with parallelism.pipeline="
                f"{cfg.parallelism_pipeline} trains on the CPU: use device='auto' or 'cpu'"
            )
        if cfg.shard_optimizer and not self.supports_sharding:
            raise ConfigError(
                f"shard_optimizer=true needs strategy="
                f"{registry.spelled(registry.having('supports_sharding'))}, got {self.name!r}"
            )
        if cfg.comm_backend == "torch" and (not self.torch_backend or pipeline):
            raise ConfigError(
                f"comm_backend='torch' averages the gradients of strategy="
                f"{registry.spelled(registry.having('torch_backend'))} "
                f"without a pipeline, not strategy={self.name!r}"
                f"{' with parallelism.pipeline > 1' if pipeline else ''}"
            )

    def opens_sockets(self, cfg: TrainConfig) -> bool:
        """Does a job of this strategy open sparktrain's own sockets (the encryption gate
        asks)? Every barrier stage does: rendezvous, metrics, state, gradients."""
        return True

    def driver(self, job: DriverJob) -> DriverHalf:
        """Start this strategy's driver-side services for ``job``."""
        return DriverHalf(job)

    def launch(self, job: FitJob) -> TrainResult:
        """Train: for a barrier strategy, one barrier stage through the stage runner."""
        from sparktrain.driver.stage_runner import train_data_parallel

        return train_data_parallel(job, self)

    # ----------------------------------------------------------------- worker half
    def worker_sync(self, ctx: WorkerContext, model: nn.Module, mesh: Mesh) -> StepSync:
        """The step sync rank ``ctx.rank`` trains with (runs in the task)."""
        raise ConfigError(f"strategy {self.name!r} does not run in a barrier stage")

    # ----------------------------------------------------------------- cost model
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
        """Predicted seconds of one step's exchange of ``nbytes`` of fp32 gradients in
        ``buckets`` collectives, optionally through ``compressor`` (the alpha-beta model
        of :mod:`sparktrain.costmodel`)."""
        if self.cost_model is None:
            raise NotImplementedError(f"strategy {self.name!r} has no cost model")
        return costmodel.comm_s(
            self.cost_model, nbytes, world, alpha, beta, compressor=compressor, buckets=buckets
        )


_PATH_EXAMPLES = {
    "reduce": "fp16",
    "allgather": "topk:0.01+ef",
    "recompress": "int8+ef",
    "resparsify": "topk:0.01+ef",
    "resparsify_tree": "topk:0.01+ef",
}
"""A spec each forced ``compression_path`` applies to (on the ring; on the tree, those
the tree has), for the error that asks for one."""


def _check_compression_path(cfg: TrainConfig, strategy: str, specs: list[str]) -> None:
    """A forced ``compression_path`` must apply to every compressed spec on this
    strategy's allreduce at ``num_workers`` (checked again where the reducer is built, for
    what only the stage knows: strategy or compression ``auto``, pipeline replicas)."""
    want = cfg.compression_path
    from sparktrain.strategies import registry

    if not registry.get(strategy).compression_paths:
        raise ConfigError(
            f"compression_path={want!r} chooses how the ring or tree allreduce moves "
            f"compressed buckets; strategy={strategy!r} has no such choice: leave "
            "compression_path='auto'"
        )
    specs = [s for s in specs if s != "none"]
    if not specs:
        example = _PATH_EXAMPLES.get(want, "topk:0.01+ef")
        raise ConfigError(
            f"compression_path={want!r} needs a compression spec (compression is 'none'): "
            f"give one, e.g. compression={example!r}, or leave compression_path='auto'"
        )
    if strategy == "auto" or "auto" in specs or cfg.parallelism_pipeline > 1:
        return  # the algorithm, compressor or group size is chosen in the stage
    from sparktrain.compress.collective import choose_path
    from sparktrain.compress.registry import build

    for spec in specs:
        comp = build(spec)
        if comp is not None:
            choose_path(comp, cfg.num_workers, strategy, want)
