"""``strategy="ps"``: a parameter server in the driver (sync, async, bounded staleness).

The driver half starts the server's shards before the stage (they hold the model and the
optimizer), hands their addresses to the ranks, tells the server each new attempt (it
refuses an older attempt's pushes), checkpoints it from the driver and, after a failed
stage, resumes at the server's own completed step: the model survives a stage restart.
The worker half pushes gradients and pulls parameters
(:class:`~sparktrain.ps.client.ParameterServerSync`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from sparktrain.config import single_spec
from sparktrain.strategies.base import DriverHalf, Strategy, loop_knobs, refuse_loop_options
from sparktrain.strategies.registry import register

if TYPE_CHECKING:
    from torch import nn

    from sparktrain.comm import Mesh
    from sparktrain.config import TrainConfig
    from sparktrain.launch.stage import DriverJob
    from sparktrain.result import TrainResult
    from sparktrain.worker.context import JobSpec, WorkerContext
    from sparktrain.worker.sync import StepSync

History = tuple[dict[str, Any], ...]


class ParameterServer(Strategy):
    """Workers push gradients to, and pull parameters from, shards in the driver."""

    name = "ps"
    cost_model = "ps"
    takes_delta = True  # pulls send deltas on what the worker already holds
    executors_write_checkpoints = False  # the server checkpoints from the driver

    def validate(self, cfg: TrainConfig) -> None:
        super().validate(cfg)
        from sparktrain.ps.protocol import make_compression

        make_compression(single_spec(cfg.compression, cfg.strategy))  # e.g. delta+powersgd
        # the server steps: clipping after averaging and a gradient scaler would have to
        # run there (accumulation, bf16 and the schedule's rate happen in the workers)
        server_side = {
            k: v
            for k, v in loop_knobs(cfg).items()
            if k == "clip_grad_norm" or (k == "precision" and v == "fp16")
        }
        refuse_loop_options(
            cfg,
            server_side,
            "strategy='ps' (the optimizer steps in the driver's server)",
            "use strategy='ring' or 'tree' for them",
        )

    def driver(self, job: DriverJob) -> DriverHalf:
        return _ServerHalf(job)

    def worker_sync(self, ctx: WorkerContext, model: nn.Module, mesh: Mesh) -> StepSync:
        from sparktrain.ps.client import ParameterServerSync

        return ParameterServerSync(ctx, model, mesh)


class _ServerHalf(DriverHalf):
    """The server and its checkpointer for one job; see the module docstring."""

    def __init__(self, job: DriverJob) -> None:
        super().__init__(job)
        from sparktrain.ps.persist import ServerCheckpointer, restore, server_store
        from sparktrain.ps.server import start_parameter_server

        cfg, spec = job.config, job.spec
        self.server = start_parameter_server(
            job.model,
            cfg,
            host=job.host,
            secret=spec.secret,
            job_id=spec.job_id,
            attempt=0,
            security=spec.security,
            max_frame_bytes=spec.max_frame_bytes,
        )
        self.saver: ServerCheckpointer | None = None
        try:
            store = server_store(cfg)
            resumed = restore(store, self.server) if store is not None and cfg.resume else None
            self.step: int | None = resumed[0] if resumed is not None else None
            self.earlier: History = tuple(resumed[1]) if resumed is not None else ()
            if store is not None:
                self.saver = ServerCheckpointer(
                    self.server,
                    store,
                    cfg.checkpoint_every,
                    self._steps_per_epoch,
                    lambda at: self._history(self.earlier, at),
                    start_step=self.step or 0,
                )
                self.saver.start()
        except BaseException:
            self.server.stop()
            raise

    def _steps_per_epoch(self) -> int:
        """Steps per epoch as the first stage reported them (0 before)."""
        return int(self.job.display._steps_per_epoch)  # read-only; learnt from rank 0

    def _history(self, earlier: History, step: int) -> History:
        from sparktrain.ps.persist import merged_history

        reported = self.job.display.history_before(step)
        return merged_history(earlier, reported, self._steps_per_epoch(), step)

    def job_spec(self, spec: JobSpec) -> JobSpec:
        return dataclasses.replace(spec, ps_addresses=tuple(self.server.addresses))

    def first_resume(self) -> tuple[int | None, History]:
        return self.step, self.earlier

    def begin_attempt(self, attempt: int) -> None:
        self.server.begin_attempt(attempt)  # keeps the server's model; rejects older attempts

    def resume_after_failure(self) -> tuple[int | None, History]:
        step = self.server.completed_step()
        return step, self._history(self.earlier, step or 0)

    def resume_source(self, step: int | None) -> str:
        if step is None:
            return "from the parameter server's model, epochs restarting (async/ssp)"
        return f"from the parameter server's model at step {step}"

    def stop(self) -> None:
        if self.saver is not None:
            self.saver.stop()
        self.server.stop()

    def finish(self, result: TrainResult) -> None:
        self.server.finish(result)  # the server's parameters are the model; its stats join


register(ParameterServer())
