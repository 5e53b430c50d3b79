"""``strategy="tree_aggregate"``: the MLlib way, one ordinary Spark job per round.

The driver holds the model and the optimizer; each round's tasks compute their
partitions' contributions and ``RDD.treeAggregate`` sums them (:mod:`.driver`; under
Spark Connect the same levels as DataFrame operations, :mod:`.driver_frames`). No barrier
stage, so no gang scheduling and no sockets of its own, except the weights server a
``delta+`` spec starts (or, under Connect, weights too large for a round's closure).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sparktrain import costmodel
from sparktrain.strategies.base import Strategy
from sparktrain.strategies.registry import register

if TYPE_CHECKING:
    from sparktrain.config import TrainConfig
    from sparktrain.costmodel import CompressorCost
    from sparktrain.driver.stage_runner import FitJob
    from sparktrain.result import TrainResult


class TreeAggregate(Strategy):
    """Synchronous rounds of ``treeAggregate`` (``local_steps > 1``: FedAvg deltas)."""

    name = "tree_aggregate"
    launcher = "rounds"
    takes_delta = True  # downloads send weight deltas on the tasks' mirror
    executors_write_checkpoints = False  # the driver holds the model and checkpoints it

    def validate(self, cfg: TrainConfig) -> None:
        super().validate(cfg)
        self._download_compressor(cfg)  # refuses delta+powersgd

    def opens_sockets(self, cfg: TrainConfig) -> bool:
        """Only a ``delta+`` spec does: it starts the driver's weights server."""
        return cfg.compression != "auto" and self._download_compressor(cfg) is not None

    @staticmethod
    def _download_compressor(cfg: TrainConfig) -> object:
        from sparktrain.strategies.tree_aggregate.codec import download_compressor

        return download_compressor(cfg.compression)

    def launch(self, job: FitJob) -> TrainResult:
        from sparktrain.strategies.tree_aggregate.driver import run_rounds

        return run_rounds(
            job.prepared,
            job.model,
            job.config,
            model_fn=job.model_fn,
            model_kwargs=job.model_kwargs,
            num_outputs=job.num_outputs,
            started=job.started,
            task_hook=job.fault.maybe_fire if job.fault else None,
            callbacks=job.callbacks,
            env=job.spark,
        )

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
        """One round without the Spark job's own scheduling overhead (measure that with
        ``sparktrain bench mllib``; :func:`costmodel.tree_aggregate_round_s` adds it)."""
        wire = nbytes / compressor.ratio if compressor is not None else nbytes
        return costmodel.tree_aggregate_round_s(wire, world, alpha, beta, job_overhead_s=0.0)


register(TreeAggregate())
