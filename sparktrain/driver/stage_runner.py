"""The stage runner: the one attempt loop of every barrier-stage job.

Data-parallel strategies (ring, tree, auto, ps, plug-ins) and pipelines all run through
:func:`run_stage`: per attempt it starts a metrics channel, a rendezvous and a state
receiver (each naming the attempt, so a straggler of an earlier attempt cannot report
into this one), sets a job group, watches for free slots on a cluster, launches one
barrier stage over the prepared data (:func:`launch`) and, when a task fails, resubmits
the stage up to ``max_restarts`` times from where the strategy's driver half says it
resumes. Data and config errors are final, and so is an exception the user's code
raised (:class:`~sparktrain.errors.UserCodeError`, :mod:`sparktrain.task.output`): only
lost tasks, executors and links are retried.

:func:`train_data_parallel` is a barrier strategy's whole fit: the job spec, the
checkpoint store, the strategy's driver half, the stage, the result.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import secrets
import time
import uuid
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from sparktrain.checkpoint import CheckpointStore, check_shared, open_for_run
from sparktrain.compress import registry as compress_registry
from sparktrain.config import TrainConfig, parse_port_range
from sparktrain.driver import gpu, occupancy
from sparktrain.driver.barrier import TaskEntry, launch
from sparktrain.driver.pickling import shippable
from sparktrain.driver.prepare import PreparedData, unscale_result
from sparktrain.driver.resources import SlotWatchdog, check_can_launch, task_cpus
from sparktrain.driver.services.loggers import make_listeners
from sparktrain.driver.services.metrics_server import MetricsServer, ProgressDisplay
from sparktrain.driver.services.payload_server import ClosureShipper
from sparktrain.driver.services.rendezvous import RendezvousServer
from sparktrain.driver.services.state_receiver import StateReceiver
from sparktrain.driver.services.task_output import OutputSink
from sparktrain.errors import CommError, ResourceError, SparkTrainError, WorkerError
from sparktrain.result import Record, TrainResult, assemble
from sparktrain.task.context import JobSpec
from sparktrain.task.faults import FaultPlan
from sparktrain.task.memory import peak_rss_bytes
from sparktrain.task.run_task import run_partition
from sparktrain.wire.listen import ServiceHost
from sparktrain.wire.security import WireSecurity

if TYPE_CHECKING:
    from torch import nn

    from sparktrain.driver.spark_env import SparkEnv
    from sparktrain.strategies.base import DriverHalf, Strategy

log = logging.getLogger(__name__)


@dataclass
class FitJob:
    """Everything the driver resolved for one fit, before any strategy runs: the
    session's Spark (classic or Connect), the prepared data, the driver's model (rank 0's
    trained state is written into it) and how to build it on the executors."""

    spark: SparkEnv
    prepared: PreparedData
    model: nn.Module
    model_fn: Any
    model_kwargs: dict[str, Any]
    config: TrainConfig
    num_outputs: int
    started: float
    fault: FaultPlan | None = None
    # user callbacks (sparktrain.driver.services.loggers.Callback or fn(record, history)),
    # on the driver
    callbacks: Sequence[Any] = ()
    # sparktrain.run: rank 0's tensors land here as sent (no driver model to check against)
    received: dict[str, torch.Tensor] | None = None

    def job_spec(self, strategy: Strategy | None) -> JobSpec:
        """A new job's spec for attempt 0 (a fresh job id and secret)."""
        cfg = self.config
        return JobSpec(
            job_id=uuid.uuid4().hex[:12],
            attempt=0,
            secret=secrets.token_bytes(32),
            config=cfg,
            model_fn=self.model_fn,
            model_kwargs=self.model_kwargs,
            feature_width=self.prepared.feature_width,
            layout=self.prepared.layout,
            label_scale=self.prepared.label_scale,
            num_outputs=self.num_outputs,
            threads=cfg.threads_per_worker or task_cpus(self.spark),
            fault=self.fault,
            security=WireSecurity.for_job(cfg.encryption, cfg.frame_integrity),
            strategy=strategy,
            compressors=compress_registry.plugins(),
        )


@dataclass
class DriverJob:
    """What a strategy's driver half is started with."""

    model: nn.Module
    config: TrainConfig
    host: str
    spec: JobSpec
    display: ProgressDisplay
    store: CheckpointStore | None


@dataclass
class StageOutcome:
    """The records of the attempt that finished, and what it took to get there."""

    records: list[Record]
    restarts: int
    steps_redone: int
    stage_s: float
    # False: the tasks could not reach the driver's services and met through Spark
    driver_reached: bool = True
    # Spark Connect: how the last attempt shipped its task (ClosureShipper.summary)
    task_closure: dict[str, Any] | None = None


def driver_host(env: SparkEnv, cfg: TrainConfig) -> ServiceHost:
    """The address the driver's services listen on (the executors dial it), with their
    port range: ``driver_services_host``/``driver_services_ports``, else Spark's driver
    host (under Spark Connect the services run in this client process, see
    :meth:`~sparktrain.driver.spark_env.ConnectEnv.driver_host`)."""
    host = cfg.driver_services_host or env.driver_host()
    return ServiceHost(host, parse_port_range(cfg.driver_services_ports))


def unreachable_note(host: str) -> str:
    """What a run gets when its tasks cannot reach the driver's services on ``host``."""
    return (
        f"the executors could not reach the driver's services on {host}: the tasks met "
        "through Spark's barrier allGather, early stopping was decided inside the stage, "
        "and the history reached progress, metrics_jsonl, callbacks and loggers when the "
        "stage ended (no live progress). Set driver_services_host (and "
        "driver_services_ports) to an address the executors can reach for live records"
    )


def open_store(cfg: TrainConfig, master: str, *, executors_write: bool) -> CheckpointStore | None:
    """The run's checkpoint store (None without ``checkpoint_dir``). When the ranks write
    and read it, the directory must be one every executor's host shares; a new run
    first clears temporary files a killed writer left."""
    if not cfg.checkpoint_dir:
        return None
    if executors_write:
        check_shared(cfg.checkpoint_dir, master)
    return open_for_run(cfg.checkpoint_dir, cfg.keep_checkpoints, resume=cfg.resume)


def resume_step(store: CheckpointStore | None, resume: bool) -> int | None:
    """The newest intact checkpoint's step when resuming, else None (start from scratch);
    a truncated or incomplete newer one is skipped (the store logs which)."""
    if store is None or not resume:
        return None
    ckpt = store.load()
    if ckpt is None:
        log.info("no checkpoint in %s yet: starting from scratch", store.uri)
        return None
    log.info(
        "resuming from %s/%s: step %d, after %d epoch(s)",
        store.uri.rstrip("/"),
        store.main_name(ckpt.step),
        ckpt.step,
        len(ckpt.history),
    )
    return ckpt.step


def train_data_parallel(job: FitJob, strategy: Strategy) -> TrainResult:
    """A barrier strategy's fit: every task runs the built-in loop on its partition."""
    cfg = job.config

    def finish(records: list[Record], stage_s: float) -> TrainResult:
        return assemble(
            job.model, records, cfg, wall_s=time.perf_counter() - job.started, stage_s=stage_s
        )

    result = train_in_stage(job, strategy, entry=run_partition, assemble_result=finish)
    if "auto" in result.summary:
        auto = result.summary["auto"]
        log.info("auto chose %s + %s: %s", auto["strategy"], auto["compression"], auto["reason"])
    return result


def train_in_stage(
    job: FitJob,
    strategy: Strategy,
    *,
    entry: TaskEntry,
    assemble_result: Callable[[list[Record], float], TrainResult],
    spec: JobSpec | None = None,
    senders: Mapping[int, Collection[str]] | None = None,
    describe: str = "",
) -> TrainResult:
    """Open the checkpoint store, start the strategy's driver half, run the stage
    (:func:`run_stage`), stop the services and assemble the result. ``spec`` is the
    job's spec when the entry already holds it (else a new one). The run's listeners
    (callbacks, TensorBoard, MLflow) are built first: a missing package fails before
    anything starts."""
    cfg = job.config
    listeners = make_listeners(cfg, job.callbacks)
    spec = spec or job.job_spec(strategy)
    store = open_store(cfg, job.spark.master, executors_write=strategy.executors_write_checkpoints)
    display = ProgressDisplay(
        cfg.progress, cfg.metrics_jsonl, listeners=listeners, config=cfg.to_dict()
    )
    host = driver_host(job.spark, cfg)
    if job.spark.connect:
        log.info(
            "Spark Connect: the driver services (progress, rendezvous, state%s) run in this "
            "client process on %s; the executors must reach it",
            f", {strategy.driver_service}" if strategy.driver_service else "",
            host,
        )
    log.info("job %s: %s on %d workers%s", spec.job_id, cfg.strategy, cfg.num_workers, describe)
    try:
        driver = strategy.driver(DriverJob(job.model, cfg, host, spec, display, store))
        try:
            outcome = run_stage(
                job.spark,
                job.prepared,
                driver.job_spec(spec),
                driver,
                display,
                entry=entry,
                model=job.model if job.received is None else None,
                senders=senders,
                received=job.received,
            )
        finally:
            driver.stop()
    except BaseException as exc:  # KeyboardInterrupt too: an MLflow run ends KILLED
        display.fail(exc)
        raise
    finally:
        display.close()
    try:
        result = assemble_result(outcome.records, outcome.stage_s)
        result.summary.update(restarts=outcome.restarts, steps_redone=outcome.steps_redone)
        result.summary["driver_peak_rss_bytes"] = peak_rss_bytes()
        driver.finish(result)
    except BaseException as exc:
        display.fail(exc)
        raise
    if job.received is None:  # a driver model (sparktrain.run returns its own value)
        unscale_result(result, job.prepared)
    if outcome.task_closure is not None:
        result.summary["task_closure"] = outcome.task_closure
    if not outcome.driver_reached:
        result.summary["driver_services"] = unreachable_note(host)
        log.warning("%s", result.summary["driver_services"])
        display.replay(result.history)
    display.finish(result.summary, result.model)
    return result


def run_stage(
    env: SparkEnv,
    prepared: PreparedData,
    base: JobSpec,
    driver: DriverHalf,
    display: ProgressDisplay,
    *,
    entry: TaskEntry,
    model: nn.Module | None,
    senders: Mapping[int, Collection[str]] | None = None,
    received: dict[str, torch.Tensor] | None = None,
) -> StageOutcome:
    """The attempt loop: launch, and on a worker or wire failure resubmit the stage
    (``max_restarts`` times at most) from where ``driver`` says it resumes."""
    cfg = base.config
    step, history = driver.first_resume()
    launched = time.perf_counter()
    restarts = steps_redone = 0
    for attempt in itertools.count():
        driver.begin_attempt(attempt)
        spec = dataclasses.replace(base, attempt=attempt, resume_step=step, resume_history=history)
        # every rank's printed lines and failure reports (task/output.py) arrive here
        sink = OutputSink(stream=cfg.stream_output, bar=display.live_bar)
        try:
            records, met_here, closure = _attempt(
                env, prepared, spec, display, entry, model, senders, received, sink
            )
            return StageOutcome(
                records, restarts, steps_redone, time.perf_counter() - launched, met_here, closure
            )
        except SparkTrainError as exc:
            # The attempt's services have stopped: every report the ranks sent is in. An
            # exception of the user's code is final (the same code would raise again);
            # Spark may have named a peer's reaction to it (a lost connection) first.
            user = None if isinstance(exc, ResourceError) else sink.user_failure()
            if user is not None:
                raise user from exc
            # data and config errors are final; lost tasks and links are retried
            if not isinstance(exc, WorkerError | CommError) or attempt >= cfg.max_restarts:
                raise
            reached = display.last_global_step
            step, history = driver.resume_after_failure()
            steps_redone += max(0, reached - (step or 0))
            restarts += 1
            log.warning(
                "the training stage failed (%s); resubmitting it (restart %d of %d) %s",
                str(exc).removeprefix("the training stage failed: "),
                restarts,
                cfg.max_restarts,
                driver.resume_source(step),
            )
            check_can_launch(env, cfg.num_workers)  # a lost executor may leave too few
    raise AssertionError("unreachable")  # itertools.count() never ends


def _attempt(
    env: SparkEnv,
    prepared: PreparedData,
    spec: JobSpec,
    display: ProgressDisplay,
    entry: TaskEntry,
    model: nn.Module | None,
    senders: Mapping[int, Collection[str]] | None,
    received: dict[str, torch.Tensor] | None,
    sink: OutputSink,
) -> tuple[list[Record], bool, dict[str, Any] | None]:
    """One barrier stage with its own progress channel, rendezvous and state receiver:
    the ranks stream their trained state straight into ``model``
    (:mod:`sparktrain.driver.services.state_receiver`), not as task results; without a model,
    rank 0's tensors as sent go into ``received``. Returns the records, whether the
    tasks reached these services (if not, they met through Spark's barrier
    ``allGather`` and returned their state as task results) and, under Spark Connect,
    how the task was shipped: in the plan, or from a payload service when it is too big
    for Connect's request cap
    (:class:`~sparktrain.driver.services.payload_server.ClosureShipper`). The ranks'
    printed lines and failure reports go to ``sink``."""
    host = driver_host(env, spec.config)
    # every service authenticates this job's tasks of this attempt only
    job: dict[str, Any] = {
        "secret": spec.secret,
        "job_id": spec.job_id,
        "attempt": spec.attempt,
        "security": spec.security,
    }
    services: list[Any] = []
    try:
        receiver = StateReceiver(host, model, senders=senders, **job)
        services.append(receiver)
        server = MetricsServer(host, on_message=display, on_output=sink, **job)
        services.append(server)
        meeting = RendezvousServer(host, world_size=spec.config.num_workers, **job)
        services.append(meeting)
        shipper = None
        if env.connect:  # the task travels in one request, which Connect caps
            cap = env.max_request_bytes()
            shipper = ClosureShipper(cap, host, timeout=spec.config.comm_timeout, **job)
            services.append(shipper)
        spec = dataclasses.replace(
            spec,
            metrics_address=server.address,
            rendezvous_address=meeting.address,
            state_address=receiver.address,
            # local mode: the executors' streams are this terminal; say each line once
            echo_output=env.connect or not env.is_local(),
        )
        # the spec pickled here, as the task carries it: functions of a script or notebook
        # too (sparktrain.driver.pickling), and an unpicklable part fails now, by its name
        shipped = shippable(spec)
        ship = None if shipper is None else shipper.ship
        with _job_group(env, spec) as watchdog:
            try:
                records = launch(prepared, shipped, entry, ship)
            except SparkTrainError as exc:
                if watchdog is not None and watchdog.reason:  # cancelled: could never start
                    raise ResourceError(watchdog.reason) from exc
                raise
        reached = meeting.rounds_completed > 0
        if reached and not receiver.done.is_set():
            raise WorkerError(
                f"the trained state did not reach the driver ({receiver.error}); "
                "this is a bug, please report it"
            )
        if received is not None:
            received.clear()
            received.update(receiver.received)
        return records, reached, None if shipper is None else shipper.summary()
    finally:
        for service in reversed(services):
            service.stop()


@contextlib.contextmanager
def _job_group(env: SparkEnv, spec: JobSpec) -> Iterator[SlotWatchdog | None]:
    """The stage's job group (cancellable as one; named in the UI; an operation tag under
    Spark Connect), and on a cluster a watchdog that cancels it when the stage can never
    get its slots; the caller's thread-local job properties are restored afterwards.
    Slots held by an earlier job's leftovers fail the stage before it is submitted, and
    any way out but success cancels the group and waits for its tasks
    (:mod:`~sparktrain.driver.occupancy`)."""
    group = f"sparktrain-{spec.job_id}-{spec.attempt}"
    gpus = gpu.profile_id(env, spec.config)  # 0 unless the stage asks for GPUs
    if gpus:  # the slots that count are the GPU profile's
        check_can_launch(env, spec.config.num_workers, profile_id=gpus)
    else:  # a task left over from an earlier job would hold a slot for good
        occupancy.wait_for_free_slots(env, spec.config.num_workers)
    watchdog = None
    if not env.is_local():
        if env.watches_slots:
            watchdog = SlotWatchdog(env, spec.config.num_workers, group, profile_id=gpus)
        else:
            log.info(
                "Spark Connect: the client cannot watch the cluster's free slots; a stage "
                "that loses its slots before it starts waits for Spark's own barrier check"
            )
    with env.job_group(group, f"sparktrain {spec.config.strategy}: training stage"):
        try:
            with occupancy.launching(env, group):  # any way out but success cancels it
                yield watchdog
        finally:
            if watchdog is not None:
                watchdog.stop()
