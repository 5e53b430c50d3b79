"""``strategy="ps"``: a parameter server in the driver (sync, async, bounded staleness).

The driver half starts the server's shards before the stage (they hold the model and the
optimizer), hands their addresses to the ranks, tells the server each new attempt (it
refuses an older attempt's pushes), checkpoints it from the driver and, after a failed
stage, resumes at the server's own completed step: the model survives a stage restart.
The worker half pushes gradients and pulls parameters
(:class:`~sparktrain.strategies.ps.client.ParameterServerSync`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from sparktrain.config import single_spec
from sparktrain.strategies.base import DriverHalf, Strategy, loop_knobs, refuse_loop_options
from sparktrain.strategies.registry import register

if TYPE_CHECKING:
    from torch import nn

    from sparktrain.config import TrainConfig
    from sparktrain.driver.stage_runner import DriverJob
    from sparktrain.result import TrainResult
    from sparktrain.task.context import JobSpec, WorkerContext
    from sparktrain.task.step_sync import StepSync
    from sparktrain.wire import Mesh

History = tuple[dict[str, Any], ...]


class ParameterServer(Strategy):
    """Workers push gradients to, and pull parameters from, shards in the driver."""

    name = "ps"
    cost_model = "ps"
    supports_run = True
    driver_service = "parameter server"
    takes_delta = True  # pulls send deltas on what the worker already holds
    executors_write_checkpoints = False  # the server checkpoints from the driver

    def validate(self, cfg: TrainConfig) -> None:
        super().validate(cfg)
        from sparktrain.strategies.ps.protocol import make_compression

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
        from sparktrain.strategies.ps.client import ParameterServerSync

        return ParameterServerSync(ctx, model, mesh)


class _ServerHalf(DriverHalf):
    """The server and its checkpointer for one job; see the module docstring."""

    def __init__(self, job: DriverJob) -> None:
        super().__init__(job)
        from sparktrain.strategies.ps.server import start_parameter_server
        from sparktrain.strategies.ps.server_persist import (
            ServerCheckpointer,
            restore,
            server_store,
        )

        cfg, spec = job.config, job.spec
        self.attempt = 0
        self.bootstrap: Any = None
        self.server: Any = None
        if spec.train_fn is not None:  # sparktrain.run: rank 0 describes the model
            self._start_bootstrap(job)
            return
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

    def _start_bootstrap(self, job: DriverJob) -> None:
        """A ``sparktrain.run`` job: no model on the driver, so the server starts when
        rank 0 describes it (:mod:`sparktrain.strategies.ps.bootstrap`); the run's checkpoints are
        the train_fn's, and the server's model survives a restarted stage."""
        from sparktrain.strategies.ps.bootstrap import Bootstrap
        from sparktrain.strategies.ps.server import ParameterServer as Server

        spec = job.spec
        self.saver = None
        self.step, self.earlier = None, ()

        def start(values: Any, cfg: TrainConfig, tables: Any) -> None:
            self.server = Server(
                values,
                cfg,
                host=job.host,
                secret=spec.secret,
                job_id=spec.job_id,
                attempt=self.attempt,
                security=spec.security,
                max_frame_bytes=spec.max_frame_bytes,
                tables=tables,  # rank 0's sparse=True tables, served by rows
            )

        def current() -> tuple[list[str], int | None] | None:
            if self.server is None:
                return None
            return list(self.server.addresses), self.server.completed_step()

        self.bootstrap = Bootstrap(
            job.host,
            secret=spec.secret,
            job_id=spec.job_id,
            attempt=lambda: self.attempt,
            security=spec.security,
            start=start,
            current=current,
            config=job.config,
        )

    def _steps_per_epoch(self) -> int:
        """Steps per epoch as the first stage reported them (0 before)."""
        return int(self.job.display._steps_per_epoch)  # read-only; learnt from rank 0

    def _history(self, earlier: History, step: int) -> History:
        from sparktrain.strategies.ps.server_persist import merged_history

        reported = self.job.display.history_before(step)
        return merged_history(earlier, reported, self._steps_per_epoch(), step)

    def job_spec(self, spec: JobSpec) -> JobSpec:
        if self.bootstrap is not None:
            return dataclasses.replace(spec, ps_bootstrap=self.bootstrap.address)
        return dataclasses.replace(spec, ps_addresses=tuple(self.server.addresses))

    def first_resume(self) -> tuple[int | None, History]:
        if self.bootstrap is not None:
            return super().first_resume()  # the train_fn's own checkpoints
        return self.step, self.earlier

    def begin_attempt(self, attempt: int) -> None:
        self.attempt = attempt
        if self.server is not None:  # keeps the server's model; rejects older attempts
            self.server.begin_attempt(attempt)

    def resume_after_failure(self) -> tuple[int | None, History]:
        if self.bootstrap is not None:
            return super().resume_after_failure()
        step = self.server.completed_step()
        return step, self._history(self.earlier, step or 0)

    def resume_source(self, step: int | None) -> str:
        if self.bootstrap is not None:
            return super().resume_source(step) + " (the parameter server keeps its model)"
        if step is None:
            return "from the parameter server's model, epochs restarting (async/ssp)"
        return f"from the parameter server's model at step {step}"

    def stop(self) -> None:
        if self.saver is not None:
            self.saver.stop()
        if self.bootstrap is not None:
            self.bootstrap.stop()
        if self.server is not None:
            self.server.stop()

    def finish(self, result: TrainResult) -> None:
        if self.bootstrap is not None:  # no driver model: the train_fn returns its own
            if self.server is not None:
                from sparktrain.strategies.ps.server_stats import add_to_summary

                add_to_summary(result.summary, self.server.stats())
            return
        self.server.finish(result)  # the server's parameters are the model; its stats join


register(ParameterServer())
