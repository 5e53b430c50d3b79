"""The driver side: validate the job, launch the barrier stage, rebuild the trained model.

>>> from sparktrain import Trainer, TrainConfig
>>> result = Trainer("sparktrain.models:digits_mlp",
...                  TrainConfig(strategy="ring", epochs=20, lr=0.1)).fit(df)  # doctest: +SKIP
>>> result.summary["metric_value"]  # doctest: +SKIP
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
import secrets
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from sparktrain.checkpoint import CheckpointStore, check_shared, open_for_run
from sparktrain.comm.security import WireSecurity
from sparktrain.config import TrainConfig
from sparktrain.errors import (
    CommError,
    ConfigError,
    DataError,
    ResourceError,
    SparkTrainError,
    WorkerError,
)
from sparktrain.launch import barrier
from sparktrain.launch.prepare import PreparedData, prepare
from sparktrain.launch.rendezvous import RendezvousServer
from sparktrain.launch.resources import (
    SlotWatchdog,
    check_can_launch,
    check_transport_security,
    is_local,
    task_cpus,
)
from sparktrain.metrics import MetricsServer, ProgressDisplay
from sparktrain.modeling import (
    ModelFn,
    build_loss,
    build_model,
    build_optimizer,
    check_weighted_loss,
    resolve_model_fn,
)
from sparktrain.result import Record, TrainResult, assemble
from sparktrain.worker.context import JobSpec
from sparktrain.worker.faults import FaultPlan

if TYPE_CHECKING:
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

log = logging.getLogger(__name__)

# What SparkContext.setJobGroup sets in the calling thread (restored after a stage).
_JOB_GROUP_PROPERTIES = (
    "spark.jobGroup.id",
    "spark.job.description",
    "spark.job.interruptOnCancel",
)


class Trainer:
    """Data-parallel training of a torch model over a Spark DataFrame or RDD.

    Parameters
    ----------
    model_fn:
        Builds the ``torch.nn.Module``: a picklable zero-argument callable, or an
        importable ``"package.module:function"`` string.
    config:
        Every training knob (:class:`TrainConfig`).
    model_kwargs:
        Keyword arguments for ``model_fn``.
    spark:
        The session to use; the active one by default.
    """

    def __init__(
        self,
        model_fn: ModelFn,
        config: TrainConfig | None = None,
        *,
        model_kwargs: dict[str, Any] | None = None,
        spark: SparkSession | None = None,
        fault_plan: FaultPlan | None = None,
    ) -> None:
        self.model_fn = model_fn
        self.config = config or TrainConfig()
        self.config.validate()
        _check_auto(self.config)
        self.model_kwargs = dict(model_kwargs or {})
        self._spark = spark
        self._fault_plan = fault_plan  # test-only: see sparktrain.worker.faults

    def fit(
        self,
        data: Any,
        features_col: str = "features",
        label_col: str = "label",
        validation_data: Any = None,
        weight_col: str | None = None,
    ) -> TrainResult:
        """Train on ``data`` and return the model, history and summary.

        ``data`` is a DataFrame with a features column (``array<float|double>`` or an ml
        Vector) and a numeric label column, or an RDD of ``(features, label)`` pairs.
        ``validation_data`` (same kind) is evaluated after every epoch; without it,
        ``config.validation_fraction`` of each partition is held out.
        ``weight_col`` (DataFrames only) names a numeric column of sample weights ``>= 0``:
        the objective becomes the weighted mean loss ``sum w_i l_i / sum w_i`` (the
        reported training loss too); validation metrics stay unweighted.
        """
        started = time.perf_counter()
        sc = self._session().sparkContext
        # The encryption gate, before anything else and for every path (ring, tree, ps,
        # auto, pipelines, tree_aggregate's delta+ weights server). Under Spark's wire
        # encryption it may force frame integrity on: the job then runs on a copy of this
        # trainer holding the adjusted copy of the config (the caller's config is untouched).
        cfg = check_transport_security(sc, self.config)
        job = self if cfg is self.config else self._with_config(cfg)
        return job._fit(sc, started, data, features_col, label_col, validation_data, weight_col)

    def _with_config(self, cfg: TrainConfig) -> Trainer:
        job = copy.copy(self)
        job.config = cfg
        return job

    def _fit(
        self,
        sc: SparkContext,
        started: float,
        data: Any,
        features_col: str,
        label_col: str,
        validation_data: Any,
        weight_col: str | None,
    ) -> TrainResult:
        cfg = self.config
        if cfg.strategy != "tree_aggregate":  # the only strategy without a barrier stage
            check_can_launch(sc, cfg.num_workers)
        if weight_col:  # before any Spark job: can the loss take sample weights?
            check_weighted_loss(cfg.loss, dict(cfg.loss_kwargs))
        # The model, loss and optimizer are built while the driver waits on Spark's
        # data-preparation jobs: the first torch optimizer of a process imports
        # torch._dynamo (~1.5 s), time that would otherwise sit on the path to training.
        # Errors keep their order: data errors first, then the width check, then the
        # loss/optimizer settings.
        with ThreadPoolExecutor(1, thread_name_prefix="sparktrain-model") as pool:
            built = pool.submit(self._build_model)
            prepared = prepare(
                data, validation_data, features_col, label_col, cfg.num_workers, weight_col
            )
            model, settings_error = built.result()
        model, num_outputs = self._check_model(prepared.feature_width, model, settings_error)
        from sparktrain.parallel.pipeline import check_param_cap

        check_param_cap(model, cfg)  # no-op for pipelines (each stage is checked instead)
        if cfg.parallelism_pipeline > 1:
            from sparktrain.parallel.pipeline import run_pipeline

            return run_pipeline(self, sc, prepared, model, num_outputs=num_outputs, started=started)
        if cfg.strategy == "tree_aggregate":
            from sparktrain.launch.rounds import run_rounds

            hook = self._fault_plan.maybe_fire if self._fault_plan else None
            return run_rounds(
                prepared, model, cfg, num_outputs=num_outputs, started=started, task_hook=hook
            )

        base = JobSpec(
            job_id=uuid.uuid4().hex[:12],
            attempt=0,
            secret=secrets.token_bytes(32),
            config=cfg,
            model_fn=self.model_fn,
            model_kwargs=self.model_kwargs,
            feature_width=prepared.feature_width,
            num_outputs=num_outputs,
            threads=cfg.threads_per_worker or task_cpus(sc),
            fault=self._fault_plan,
            security=WireSecurity.for_job(cfg.encryption, cfg.frame_integrity),
        )
        host = sc.getConf().get("spark.driver.host", "127.0.0.1")
        store = _open_store(cfg, str(sc.master))
        # the parameter server resumes from its own checkpoints (_start_ps)
        resume_step = _resume_step(store, cfg.resume and cfg.strategy != "ps")
        display = ProgressDisplay(cfg.progress, cfg.metrics_jsonl)
        ps = ps_saver = None
        history: tuple[dict[str, Any], ...] = ()
        if cfg.strategy == "ps":
            ps, ps_saver, resume_step, history = _start_ps(model, cfg, host, base, display)
            base = dataclasses.replace(base, ps_addresses=tuple(ps.addresses))
        log.info("job %s: %s on %d workers", base.job_id, cfg.strategy, cfg.num_workers)
        launched = time.perf_counter()
        restarts = steps_redone = 0
        earlier = history  # epochs a resumed parameter-server checkpoint brought
        try:
            for attempt in itertools.count():
                if ps is not None:
                    ps.begin_attempt(attempt)  # keeps the server's model; rejects older attempts
                spec = dataclasses.replace(
                    base, attempt=attempt, resume_step=resume_step, resume_history=history
                )
                try:
                    records = self._attempt(prepared, spec, host, display, model)
                    break
                except (WorkerError, CommError) as exc:  # data and config errors are final
                    if attempt >= cfg.max_restarts:
                        raise
                    reached = display.last_global_step
                    if ps is not None:
                        from sparktrain.ps.persist import merged_history

                        resume_step = ps.completed_step()
                        history = merged_history(
                            earlier,
                            display.history_before(resume_step),
                            _steps_per_epoch(display),
                            resume_step,
                        )
                    else:
                        resume_step = _resume_step(store, True)
                    steps_redone += max(0, reached - (resume_step or 0))
                    restarts += 1
                    log.warning(
                        "the training stage failed (%s); resubmitting it (restart %d of %d) %s",
                        exc,
                        restarts,
                        cfg.max_restarts,
                        _resume_source(resume_step, ps is not None, store is not None),
                    )
                    check_can_launch(sc, cfg.num_workers)  # a lost executor may leave too few
        finally:
            display.close()
            if ps_saver is not None:
                ps_saver.stop()
            if ps is not None:
                ps.stop()
        result = assemble(
            model,
            records,
            cfg,
            wall_s=time.perf_counter() - started,
            stage_s=time.perf_counter() - launched,
        )
        result.summary.update(restarts=restarts, steps_redone=steps_redone)
        from sparktrain.worker.memory import peak_rss_bytes

        result.summary["driver_peak_rss_bytes"] = peak_rss_bytes()
        if "auto" in result.summary:
            auto = result.summary["auto"]
            log.info(
                "auto chose %s + %s: %s", auto["strategy"], auto["compression"], auto["reason"]
            )
        if ps is not None:
            ps.finish(result)  # the server's parameters are the model; its stats join the summary
        return result

    def _attempt(
        self,
        prepared: PreparedData,
        spec: JobSpec,
        host: str,
        display: ProgressDisplay,
        model: nn.Module | None = None,
    ) -> list[Record]:
        """One barrier stage, with its own progress channel and rendezvous (the handshake
        names the attempt, so a straggler of an earlier attempt cannot report into this
        one or join its all-gather). With ``model``, rank 0 streams its trained state
        straight into it (:mod:`sparktrain.launch.state_server`), not as a task result."""
        from sparktrain.launch.state_server import StateReceiver

        receiver = (
            None
            if model is None
            else StateReceiver(
                host,
                model,
                secret=spec.secret,
                job_id=spec.job_id,
                attempt=spec.attempt,
                security=spec.security,
            )
        )
        server = MetricsServer(
            host,
            secret=spec.secret,
            job_id=spec.job_id,
            attempt=spec.attempt,
            on_message=display,
            security=spec.security,
        )
        meeting = RendezvousServer(
            host,
            secret=spec.secret,
            job_id=spec.job_id,
            attempt=spec.attempt,
            world_size=self.config.num_workers,
            security=spec.security,
        )
        sc = self._session().sparkContext
        group = f"sparktrain-{spec.job_id}-{spec.attempt}"
        saved = {k: sc.getLocalProperty(k) for k in _JOB_GROUP_PROPERTIES}
        sc.setJobGroup(group, f"sparktrain {self.config.strategy}: training stage", True)
        watchdog = None if is_local(sc) else SlotWatchdog(sc, self.config.num_workers, group)
        try:
            records = self._launch(
                prepared,
                dataclasses.replace(
                    spec,
                    metrics_address=server.address,
                    rendezvous_address=meeting.address,
                    state_address=receiver.address if receiver is not None else None,
                ),
            )
            if receiver is not None and not receiver.done.is_set():
                raise WorkerError(
                    f"rank 0's trained state did not reach the driver ({receiver.error}); "
                    "this is a bug, please report it"
                )
            return records
        except SparkTrainError as exc:
            if watchdog is not None and watchdog.reason:  # cancelled: it could never start
                raise ResourceError(watchdog.reason) from exc
            raise
        finally:
            if watchdog is not None:
                watchdog.stop()
            for key, value in saved.items():
                sc.setLocalProperty(key, value)  # type: ignore[arg-type]
            meeting.stop()
            server.stop()
            if receiver is not None:
                receiver.stop()

    # ------------------------------------------------------------------ internals
    def _session(self) -> SparkSession:
        if self._spark is not None:
            return self._spark
        from sparktrain.session import get_or_create_session

        return get_or_create_session()

    def _build_model(self) -> tuple[nn.Module, Exception | None]:
        """Build the model once on the driver (seeded as the workers do) and try the loss
        and optimizer settings on it; their error, if any, is returned for
        :meth:`_check_model` to raise after the width check."""
        cfg = self.config
        torch.manual_seed(cfg.seed)
        model = build_model(resolve_model_fn(self.model_fn, self.model_kwargs))
        try:
            build_loss(cfg.loss, dict(cfg.loss_kwargs))
            build_optimizer(cfg.optimizer, model.parameters(), cfg.lr, dict(cfg.optimizer_kwargs))
        except Exception as exc:
            return model, exc
        return model, None

    def _check_model(
        self, width: int, model: nn.Module, settings_error: Exception | None = None
    ) -> tuple[nn.Module, int]:
        """Does the driver's model take this feature width, and do the loss and optimizer
        settings fit it? Fails here rather than in every task."""
        cfg = self.config
        model.eval()
        try:
            with torch.no_grad():
                out = model(torch.zeros(2, width))
        except Exception as exc:
            raise DataError(
                f"the model does not accept features of width {width} ({exc}); check the "
                "features column or the model's input size"
            ) from exc
        num_outputs = int(out.shape[1]) if out.ndim == 2 else 1
        if cfg.loss == "cross_entropy" and num_outputs < 2:
            raise ConfigError(
                f"loss='cross_entropy' needs one output per class, the model has {num_outputs}; "
                "use bce_with_logits for a single logit"
            )
        if settings_error is not None:
            raise settings_error
        return model.train(), num_outputs

    def _launch(self, prepared: PreparedData, spec: JobSpec) -> list[Record]:
        try:
            try:
                return barrier.run(prepared, spec)
            except Exception as exc:
                if not barrier.is_unsupported_chain(exc):
                    raise
            # Spark refuses barrier stages over a union or coalesce whose partition counts
            # differ (checked at submission, before any task runs): shuffle and retry.
            log.info(
                "the input's lineage cannot feed a barrier stage (union/coalesce); "
                "shuffling it into %d partitions",
                self.config.num_workers,
            )
            return barrier.run(prepared.shuffled(self.config.num_workers), spec)
        except SparkTrainError:
            raise
        except Exception as exc:  # Py4J / PythonException wrapping a task's error
            raise WorkerError.from_spark(exc) from exc


def _check_auto(cfg: TrainConfig) -> None:
    """``auto`` is decided inside the barrier stage by a probe of the workers' links
    (:mod:`sparktrain.worker.probe`), choosing ring or tree and a compressor; say so
    before any Spark job when the config asks for it where it cannot run."""
    if cfg.compression == "auto" and cfg.strategy in ("ps", "tree_aggregate"):
        raise ConfigError(
            f"compression='auto' is chosen inside the barrier stage for the ring or tree "
            f"allreduce; with strategy={cfg.strategy!r} give a compressor (e.g. 'fp16', "
            "'topk:0.01+ef') or 'none', or use strategy='auto'"
        )
    if cfg.parallelism_pipeline > 1 and "auto" in (cfg.strategy, cfg.compression):
        raise ConfigError(
            "strategy/compression 'auto' do not combine with parallelism.pipeline > 1: "
            "give strategy='ring' and a compression spec"
        )


def _open_store(cfg: TrainConfig, master: str) -> CheckpointStore | None:
    """The run's checkpoint store (None without ``checkpoint_dir``). Every rank of a
    ring/tree run writes its shard there and reads the checkpoint back, so the directory
    must be one that every executor's host shares; a new run first clears temporary
    files a killed writer left."""
    if not cfg.checkpoint_dir:
        return None
    if cfg.strategy != "ps":  # the parameter server's checkpoints are the driver's own
        check_shared(cfg.checkpoint_dir, master)
    return open_for_run(cfg.checkpoint_dir, cfg.keep_checkpoints, resume=cfg.resume)


def _resume_step(store: CheckpointStore | None, resume: bool) -> int | None:
    """The newest intact checkpoint's step when resuming, else None (start from scratch);
    a truncated or incomplete newer one is skipped (the store logs which)."""
    if store is None or not resume:
        return None
    step = store.newest_intact()
    if step is None:
        log.info("no checkpoint in %s yet: starting from scratch", store.uri)
    return step


def _resume_source(step: int | None, parameter_server: bool, checkpoints: bool) -> str:
    """Where a resubmitted stage continues from, for the log."""
    if parameter_server:
        if step is None:
            return "from the parameter server's model, epochs restarting (async/ssp)"
        return f"from the parameter server's model at step {step}"
    if step is not None:
        return f"from the checkpoint of step {step}"
    hint = "" if checkpoints else " (set checkpoint_dir to keep progress)"
    return "from scratch: no checkpoint to resume from" + hint


def _start_ps(
    model: nn.Module, cfg: TrainConfig, host: str, base: JobSpec, display: ProgressDisplay
) -> tuple[Any, Any, int | None, tuple[dict[str, Any], ...]]:
    """Start the parameter server; with ``resume`` load its newest checkpoint, with a
    ``checkpoint_dir`` start its checkpointer (see :mod:`sparktrain.ps.persist`).
    Returns the server, the checkpointer (or None), the resume step and its history."""
    from sparktrain.ps.persist import ServerCheckpointer, merged_history, restore, server_store
    from sparktrain.ps.server import start_parameter_server

    ps = start_parameter_server(
        model,
        cfg,
        host=host,
        secret=base.secret,
        job_id=base.job_id,
        attempt=0,
        security=base.security,
        max_frame_bytes=base.max_frame_bytes,
    )
    try:
        store = server_store(cfg)
        resumed = restore(store, ps) if store is not None and cfg.resume else None
        step, history = resumed if resumed is not None else (None, ())
        saver = None
        if store is not None:
            saver = ServerCheckpointer(
                ps,
                store,
                cfg.checkpoint_every,
                lambda: _steps_per_epoch(display),
                lambda at: merged_history(
                    history, display.history_before(at), _steps_per_epoch(display), at
                ),
                start_step=step or 0,
            )
            saver.start()
    except BaseException:
        ps.stop()
        raise
    return ps, saver, step, history


def _steps_per_epoch(display: ProgressDisplay) -> int:
    """Steps per epoch as the first stage reported them (0 before)."""
    return int(display._steps_per_epoch)  # read-only; the display learns it from rank 0
