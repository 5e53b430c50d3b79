"""Callbacks and experiment loggers: what the driver does with each record of a run.

Rank 0 sends its records to the driver (:mod:`sparktrain.task.metrics_client`); the
driver's :class:`~sparktrain.driver.services.metrics_server.ProgressDisplay` hands them to a list
of *listeners*, objects with the four methods of :class:`RunListener`. Three kinds come
with sparktrain:

- user callbacks: a :class:`Callback` subclass, or a plain function
  ``fn(record, history)``, called after every epoch (or ``sparktrain.run`` report);
- :class:`TensorBoardLogger` (``tensorboard_dir``): scalars in TensorBoard event files;
- :class:`MLflowLogger` (``mlflow_tracking_uri``, ``mlflow_experiment``): an MLflow run
  with the config as parameters, the records as metric histories, and the final
  summary and weights as artifacts.

:func:`make_listeners` builds them from a :class:`~sparktrain.config.TrainConfig`.

Where and when listeners run
    ``on_start`` and ``on_record`` run on the driver, on the thread that reads rank 0's
    channel (not the thread that called ``fit``), one call at a time and in order;
    ``on_finish`` and ``on_error`` run on the thread that called ``fit``, after the
    stage. Records arrive after the epoch ended on the workers, which do not wait for
    the driver: a slow listener delays the progress bar, not training.

Failures
    A listener that raises never ends training: the first exception of each listener is
    logged with its traceback (``log.exception``), later ones only counted (a
    warning at the end of the run says how many), and every listener, the failing one
    included, keeps receiving the run's events. Wrong *setup* is different: a logger whose
    package is missing or whose tracking URI cannot be used raises
    :class:`~sparktrain.errors.ConfigError` from :func:`make_listeners`, before the stage
    starts.

Credentials
    Listeners see the config and the summary with the user name and password of every
    URI removed and secret-looking query values (``?token=``) masked
    (:mod:`sparktrain.redact`): ``mlflow_tracking_uri = "https://me:token@host/"`` is
    recorded as ``https://host/``. So are this module's log lines, tracebacks included.
    The MLflow client itself is given the URI as configured.

Lifecycle (:class:`ListenerGroup` guarantees it)
    ``on_start`` once, first (also when rank 0's ``start`` message never arrived);
    ``on_record`` per record; then exactly one of ``on_finish`` (success) or ``on_error``
    (the fit raised). A resubmitted stage does not start the run again.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import re
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from sparktrain.errors import ConfigError
from sparktrain.redact import redact_text, redact_values

if TYPE_CHECKING:
    from torch import nn

    from sparktrain.config import TrainConfig

log = logging.getLogger(__name__)


class _RedactFilter(logging.Filter):
    """Removes credentials from this module's log records, the traceback included: an
    MLflow error names the request's URL, which holds the tracking URI's userinfo."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = redact_text(record.getMessage()), None
        if record.exc_info and record.exc_info[1] is not None and not record.exc_text:
            # formatters print exc_text when set, in place of formatting exc_info again
            text = "".join(traceback.format_exception(*record.exc_info))
            record.exc_text = redact_text(text.rstrip("\n"))
        return True


log.addFilter(_RedactFilter())


@runtime_checkable
class RunListener(Protocol):
    """What the driver calls with a run's events (see the module docstring for threads,
    order and failures)."""

    def on_start(self, info: dict[str, Any]) -> None:
        """The run began: rank 0's ``start`` message (``epochs``, ``steps_per_epoch``,
        ``world_size``, ``train_samples`` where known) and the run's config dict under
        ``"config"``."""

    def on_record(self, record: dict[str, Any], history: list[dict[str, Any]]) -> None:
        """An ``epoch`` or ``report`` record; ``history`` holds every record of the run so
        far, this one last."""

    def on_finish(self, summary: dict[str, Any], model: nn.Module | None) -> None:
        """The fit succeeded: its summary (see docs/summary.md) and the trained model."""

    def on_error(self, error: BaseException) -> None:
        """The fit raised ``error`` (it still reaches the caller); nothing follows."""


class Callback:
    """Base class of user callbacks: override :meth:`on_epoch_end` (and, if useful,
    :meth:`on_train_begin` / :meth:`on_train_end`).

    Callbacks are plain Python on the driver, called on a background thread while the
    workers go on training: they see each record after its epoch ended, cannot stop or
    change the run, and must guard state they share with other threads. An exception is
    logged, never raised into training. A plain function ``fn(record, history)`` works
    as a callback too.
    """

    def on_train_begin(self, info: dict[str, Any]) -> None:
        """The run began (``info``: see :meth:`RunListener.on_start`). Default: nothing."""

    def on_epoch_end(self, record: dict[str, Any], history: list[dict[str, Any]]) -> None:
        """An epoch (or report) record arrived; ``history`` is every record so far, this
        one last. Default: nothing."""

    def on_train_end(self, summary: dict[str, Any], model: nn.Module | None) -> None:
        """The fit succeeded (not called when it failed). Default: nothing."""


class _CallbackListener:
    """A :class:`Callback` or a function ``fn(record, history)`` as a listener."""

    def __init__(self, callback: Callback | Callable[..., Any]) -> None:
        self.callback = callback

    def __repr__(self) -> str:
        return f"callback {_name_of(self.callback)}"

    def on_start(self, info: dict[str, Any]) -> None:
        if isinstance(self.callback, Callback):
            self.callback.on_train_begin(info)

    def on_record(self, record: dict[str, Any], history: list[dict[str, Any]]) -> None:
        # a copy: a callback that keeps the list sees the history of its own call
        if isinstance(self.callback, Callback):
            self.callback.on_epoch_end(record, list(history))
        else:
            self.callback(record, list(history))

    def on_finish(self, summary: dict[str, Any], model: nn.Module | None) -> None:
        if isinstance(self.callback, Callback):
            self.callback.on_train_end(summary, model)

    def on_error(self, error: BaseException) -> None:
        pass


def as_listener(callback: Any) -> RunListener:
    """A callback as a listener: a :class:`Callback`, a function ``fn(record, history)``,
    or an object that already has the four :class:`RunListener` methods (taken as is)."""
    if isinstance(callback, Callback):
        return _CallbackListener(callback)
    if isinstance(callback, RunListener):
        return callback
    if callable(callback):
        return _CallbackListener(callback)
    raise ConfigError(
        f"callbacks: {callback!r} is neither a sparktrain.driver.services.loggers.Callback nor "
        "a function fn(record, history)"
    )


def figures(record: Mapping[str, Any]) -> dict[str, int | float]:
    """A record's numeric figures by name, in the record's order: every int or float
    except ``epoch`` (booleans are not figures). An epoch record's ``metric`` is named by
    its ``metric_name`` (``"accuracy"``, ``"rmse"``, ...)."""
    name = record.get("metric_name")
    out: dict[str, int | float] = {}
    for key, value in record.items():
        if key == "epoch" or isinstance(value, bool) or not isinstance(value, numbers.Real):
            continue
        if key == "metric" and isinstance(name, str) and name:
            key = name
        out[key] = value if isinstance(value, int) else float(value)
    return out


class ListenerGroup:
    """Listeners called as one, in order, each guarded: an exception is logged (first
    one with its traceback) and the others still run. Keeps the lifecycle of the module
    docstring: ``start`` once (also implied by the first other event), nothing after
    ``finish`` or ``error``. Not thread-safe by itself: the caller serialises calls
    (:class:`~sparktrain.driver.services.metrics_server.ProgressDisplay` holds its lock)."""

    def __init__(
        self, listeners: Sequence[RunListener], config: Mapping[str, Any] | None = None
    ) -> None:
        self.listeners = list(listeners)
        # what every listener records: no credentials (module docstring)
        self.config: dict[str, Any] = redact_values(dict(config or {}))
        self.failures = [0] * len(self.listeners)
        self.started = False
        self.ended = False

    def start(self, message: Mapping[str, Any] | None = None) -> None:
        if self.started or self.ended:
            return
        self.started = True
        info = {"type": "start", **(message or {}), "config": self.config}
        self._each("on_start", info)

    def record(self, record: dict[str, Any], history: list[dict[str, Any]]) -> None:
        if self.ended:
            return
        self.start()
        self._each("on_record", record, history)

    def finish(self, summary: dict[str, Any], model: nn.Module | None) -> None:
        if self.ended:
            return
        self.start()
        self.ended = True
        self._each("on_finish", redact_values(summary), model)
        self._report_failures()

    def error(self, error: BaseException) -> None:
        if self.ended:
            return
        self.start()
        self.ended = True
        self._each("on_error", error)
        self._report_failures()

    def _each(self, method: str, *args: Any) -> None:
        for i, listener in enumerate(self.listeners):
            try:
                getattr(listener, method)(*args)
            except Exception:
                self.failures[i] += 1
                if self.failures[i] == 1:  # once: a broken server must not flood the log
                    log.exception(
                        "%s failed in %s; training goes on (later failures are counted)",
                        _name_of(listener),
                        method,
                    )

    def _report_failures(self) -> None:
        for listener, count in zip(self.listeners, self.failures, strict=True):
            if count > 1:
                log.warning("%s failed %d times during the run", _name_of(listener), count)


def _name_of(obj: Any) -> str:
    if isinstance(obj, _CallbackListener):
        return repr(obj)
    if callable(obj) and hasattr(obj, "__qualname__"):
        return str(obj.__qualname__)
    return type(obj).__name__


def _missing(package: str, key: str, extra: str) -> ConfigError:
    return ConfigError(f"{key} needs the {package} package: pip install 'sparktrain[{extra}]'")


def flatten_params(config: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted key, leaf value)`` pairs of a nested config dict; an empty table is a
    leaf (``{}``) so that its key still shows."""
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            yield from flatten_params(value, f"{name}.")
        else:
            yield name, value


def _param_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, default=str)  # lists and tables as their TOML-like JSON
    except ValueError:  # a circular structure; never from TrainConfig.to_dict
        return str(value)


def truncate(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters, ending in ``...`` when cut."""
    if len(text) <= limit:
        return text
    if limit <= 3:
        return text[: max(0, limit)]
    return text[: limit - 3] + "..."


# ---------------------------------------------------------------------- TensorBoard
class TensorBoardLogger:
    """TensorBoard event files in ``log_dir``: every figure of every record as a scalar
    at step = the record's ``epoch`` (see :func:`figures`), the config as text at the
    start, and at the end the config as hyperparameters (HParams tab) with the last
    record's figures as their metrics. Flushed after every record.

    TensorBoard shows one directory as one run: give each run a directory of its own.
    Raises :class:`~sparktrain.errors.ConfigError` when ``tensorboard`` is not installed.
    """

    def __init__(self, log_dir: str) -> None:
        try:
            # torch's writer imports the tensorboard package (protobufs, event format)
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise _missing("tensorboard", "tensorboard_dir", "tensorboard") from exc
        self.log_dir = log_dir
        self._writer_class = SummaryWriter
        self._writer: Any = None
        self._config: dict[str, Any] = {}
        self._last: dict[str, int | float] = {}

    def on_start(self, info: dict[str, Any]) -> None:
        # made here, not in __init__: a run that never starts leaves no empty event file
        self._writer = self._writer_class(log_dir=self.log_dir)
        self._config = dict(info.get("config", {}))
        text = json.dumps(self._config, indent=2, sort_keys=True, default=str)
        # four-space indent: a markdown code block in the Text tab
        self._writer.add_text("config", "\n".join("    " + line for line in text.splitlines()))
        self._writer.flush()

    def on_record(self, record: dict[str, Any], history: list[dict[str, Any]]) -> None:
        step = int(record.get("epoch", len(history) - 1))
        for tag, value in figures(record).items():
            self._writer.add_scalar(tag, value, global_step=step)
            self._last[tag] = value
        self._writer.flush()  # TensorBoard shows the epoch now, not at the end

    def on_finish(self, summary: dict[str, Any], model: nn.Module | None) -> None:
        try:
            self._write_hparams()
        finally:
            self._close()

    def on_error(self, error: BaseException) -> None:
        self._close()

    def _write_hparams(self) -> None:
        from torch.utils.tensorboard.summary import hparams

        values: dict[str, Any] = {}
        for key, value in flatten_params(self._config):
            plain = isinstance(value, bool | int | float) and not (
                isinstance(value, float) and not math.isfinite(value)
            )
            values[key] = value if plain else _param_text(value)
        finite = {k: v for k, v in self._last.items() if math.isfinite(v)}
        # into this run's own file: SummaryWriter.add_hparams would start a second run
        for summary in hparams(values, finite):
            self._writer.file_writer.add_summary(summary)

    def _close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


# ---------------------------------------------------------------------- MLflow
# MLflow's limits (mlflow.utils.validation); the parameter length is read from the
# installed version (6000 characters in MLflow 3), this older, lower one if it does not say
_MAX_PARAM_LENGTH = 500
_MAX_KEY_LENGTH = 250
_PARAMS_PER_BATCH = 100
_METRICS_PER_BATCH = 1000
_BAD_KEY_CHARS = re.compile(r"[^\w./\- ]")  # MLflow accepts letters, digits, _ - . / space


def _key(name: str) -> str:
    """A metric or parameter name MLflow accepts (e.g. from a user's ``report`` key)."""
    return truncate(_BAD_KEY_CHARS.sub("_", name), _MAX_KEY_LENGTH) or "_"


class MLflowLogger:
    """An MLflow run under ``experiment`` (created if missing) at ``tracking_uri``.

    - start: the config as parameters (nested tables as dotted keys, values as text,
      cut to MLflow's length limit), and rank 0's start figures as ``run.*`` parameters;
    - every record: its figures (:func:`figures`) as metrics at step = ``epoch``;
    - finish: the summary's scalar figures as ``summary.*`` metrics, the summary as the
      artifact ``summary.json``, and the final weights as ``model/state_dict.pt``
      (``torch.save(model.state_dict())``; load with
      ``model.load_state_dict(torch.load(path, weights_only=True))``), then the run ends
      FINISHED;
    - error: the run ends FAILED (KILLED on ``KeyboardInterrupt``), the error as the tag
      ``sparktrain.error``.

    It talks to MLflow through :class:`mlflow.tracking.MlflowClient`, not the fluent
    ``mlflow.start_run``: events come from two threads and the fluent API's active run
    is per thread; a run that the calling thread has active becomes the parent of this
    one. The model is logged as weights, not as a pickled ``mlflow.pytorch`` model: no
    code is pickled, and ``mlflow-skinny`` suffices.

    Raises :class:`~sparktrain.errors.ConfigError` when ``mlflow`` is not installed or
    the tracking URI cannot be used (MLflow 3 refuses a ``file:`` store unless
    ``MLFLOW_ALLOW_FILE_STORE=true`` is set).
    """

    def __init__(self, tracking_uri: str, experiment: str, run_name: str | None = None) -> None:
        try:
            import mlflow
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise _missing("mlflow", "mlflow_tracking_uri", "mlflow") from exc
        self.tracking_uri, self.experiment, self.run_name = tracking_uri, experiment, run_name
        try:
            # builds the store now: an unknown scheme or a refused file store fails here
            self._client = MlflowClient(tracking_uri)
        except Exception as exc:
            # the message reaches logs and tracebacks: no credentials in it
            raise ConfigError(
                f"mlflow_tracking_uri={redact_text(tracking_uri)!r} cannot be used: "
                f"{redact_text(str(exc))}"
            ) from None
        active = mlflow.active_run()  # the thread calling fit builds the listeners
        self._parent = active.info.run_id if active is not None else None
        self.run_id: str | None = None
        try:
            from mlflow.utils import validation

            self._max_param = int(getattr(validation, "MAX_PARAM_VAL_LENGTH", _MAX_PARAM_LENGTH))
        except ImportError:
            self._max_param = _MAX_PARAM_LENGTH

    def on_start(self, info: dict[str, Any]) -> None:
        from mlflow.entities import Param

        experiment_id = self._experiment_id()
        tags = {"mlflow.source.name": "sparktrain"}
        if self._parent is not None:
            tags["mlflow.parentRunId"] = self._parent
        run = self._client.create_run(experiment_id, run_name=self.run_name, tags=tags)
        self.run_id = run.info.run_id
        pairs = list(flatten_params(info.get("config", {})))
        pairs += [(f"run.{k}", v) for k, v in info.items() if k not in ("type", "config")]
        params = [Param(_key(k), truncate(_param_text(v), self._max_param)) for k, v in pairs]
        for i in range(0, len(params), _PARAMS_PER_BATCH):
            self._client.log_batch(self.run_id, params=params[i : i + _PARAMS_PER_BATCH])

    def on_record(self, record: dict[str, Any], history: list[dict[str, Any]]) -> None:
        step = int(record.get("epoch", len(history) - 1))
        self._log_metrics(figures(record), step)

    def on_finish(self, summary: dict[str, Any], model: nn.Module | None) -> None:
        if self.run_id is None:
            return
        try:
            top = {f"summary.{k}": v for k, v in figures(summary).items()}
            self._log_metrics(top, 0)
            with tempfile.TemporaryDirectory(prefix="sparktrain-mlflow-") as tmp:
                path = Path(tmp) / "summary.json"
                path.write_text(json.dumps(summary, indent=2, default=str))
                self._client.log_artifact(self.run_id, str(path))
                if model is not None:
                    import torch

                    path = Path(tmp) / "state_dict.pt"
                    torch.save(model.state_dict(), path)
                    self._client.log_artifact(self.run_id, str(path), artifact_path="model")
        finally:
            # training succeeded even if an upload did not: the run ends FINISHED
            self._client.set_terminated(self.run_id, "FINISHED")

    def on_error(self, error: BaseException) -> None:
        if self.run_id is None:
            return
        try:
            text = redact_text(f"{type(error).__name__}: {error}")
            self._client.set_tag(self.run_id, "sparktrain.error", truncate(text, 5000))
        finally:
            status = "KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED"
            self._client.set_terminated(self.run_id, status)

    def _experiment_id(self) -> str:
        found = self._client.get_experiment_by_name(self.experiment)
        if found is not None:
            return str(found.experiment_id)
        try:
            return str(self._client.create_experiment(self.experiment))
        except Exception:
            # another run created it meanwhile
            found = self._client.get_experiment_by_name(self.experiment)
            if found is None:
                raise
            return str(found.experiment_id)

    def _log_metrics(self, values: Mapping[str, int | float], step: int) -> None:
        if self.run_id is None or not values:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(_key(k), float(v), now, step) for k, v in values.items()]
        for i in range(0, len(metrics), _METRICS_PER_BATCH):
            self._client.log_batch(self.run_id, metrics=metrics[i : i + _METRICS_PER_BATCH])


def make_listeners(
    cfg: TrainConfig, callbacks: Sequence[Callback | Callable[..., Any]] = ()
) -> list[RunListener]:
    """The listeners of a run: the loggers ``cfg`` turns on (``tensorboard_dir``,
    ``mlflow_tracking_uri``), then ``callbacks`` (see :func:`as_listener`).

    Built now, on purpose: a missing package or an unusable tracking URI raises
    :class:`~sparktrain.errors.ConfigError` before any stage starts."""
    listeners: list[RunListener] = []
    # loggers first: a callback's failure or delay never holds back the logs
    if cfg.tensorboard_dir:
        listeners.append(TensorBoardLogger(cfg.tensorboard_dir))
    if cfg.mlflow_tracking_uri:
        listeners.append(MLflowLogger(cfg.mlflow_tracking_uri, cfg.mlflow_experiment))
    listeners.extend(as_listener(cb) for cb in callbacks)
    return listeners
