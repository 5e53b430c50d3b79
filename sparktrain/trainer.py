"""The user's way in: validate the job, prepare the data, build the model on the driver,
and hand the fit to the strategy (or the pipeline); the result comes back in the model.

>>> from sparktrain import Trainer, TrainConfig
>>> result = Trainer("sparktrain.models:digits_mlp",
...                  TrainConfig(strategy="ring", epochs=20, lr=0.1)).fit(df)  # doctest: +SKIP
>>> result.summary["metric_value"]  # doctest: +SKIP
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from sparktrain.builders import (
    ModelFn,
    build_loss,
    build_model,
    check_optimizer,
    check_weighted_loss,
    resolve_model_fn,
)
from sparktrain.config import TrainConfig
from sparktrain.data.batch import forward, forward_params, sample_batch
from sparktrain.data.columns import RAGGED, ColumnsSpec, Layout
from sparktrain.driver.job import OpenJob, check_job, open_job
from sparktrain.driver.prepare import unscale_result
from sparktrain.driver.stage_runner import FitJob
from sparktrain.errors import ConfigError, DataError
from sparktrain.parallel.pipeline import check_param_cap, run_pipeline
from sparktrain.result import TrainResult
from sparktrain.task.faults import FaultPlan

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


class Trainer:
    """Training of a torch model over a Spark DataFrame or RDD: data parallel through the
    configured strategy, or pipeline parallel with ``parallelism.pipeline > 1``.

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
        self.config.validate()  # the config's own keys (it may have been changed since)
        check_job(self.config)  # then its strategy's view of them, before Spark starts
        self.model_kwargs = dict(model_kwargs or {})
        self._spark = spark
        self._fault_plan = fault_plan  # test-only: see sparktrain.task.faults

    def fit(
        self,
        data: Any,
        features_col: ColumnsSpec = "features",
        label_col: str | Sequence[str] = "label",
        validation_data: Any = None,
        weight_col: str | None = None,
        callbacks: Sequence[Any] = (),
    ) -> TrainResult:
        """Train on ``data`` and return the model, history and summary.

        ``data`` is a DataFrame, or an RDD of ``(features, label)`` pairs (classic
        sessions only: a Spark Connect session takes DataFrames). The fit runs in the
        trainer's ``spark`` session, else in the session the DataFrame belongs to, else
        in the active one.
        ``features_col`` names the model's inputs: one column (``model(x)``; an ml Vector,
        a numeric array or, with a config's column options, any input column), a list of
        columns (``model(a, b)``) or a ``{model_argument: column}`` mapping
        (``model(a=..., b=...)``); integer columns arrive as int64, floats as float32
        unless ``feature_dtypes`` says otherwise, arrays in the shape ``feature_shapes``
        gives, variable-length arrays padded with a mask, bytes through ``decode`` (see
        :mod:`sparktrain.data.columns`). ``label_col`` is a numeric column, a numeric
        array column (``k`` targets a row) or a list of numeric columns.
        ``validation_data`` (same kind) is evaluated after every epoch; without it,
        ``config.validation_fraction`` of each partition is held out.
        ``weight_col`` (DataFrames only) names a numeric column of sample weights ``>= 0``:
        the objective becomes the weighted mean loss ``sum w_i l_i / sum w_i`` (the
        reported training loss too); validation metrics stay unweighted.
        """
        started = time.perf_counter()
        opened = open_job(
            self.config,
            data,
            validation_data,
            spark=self._spark,
            columns=features_col,
            label_col=label_col,
        )
        # the job runs on a copy of this trainer when the encryption gate adjusted the
        # config (the caller's config is untouched)
        job = self if opened.config is self.config else self._with_config(opened.config)
        return job._fit(
            opened, started, data, features_col, label_col, validation_data, weight_col, callbacks
        )

    def _with_config(self, cfg: TrainConfig) -> Trainer:
        job = copy.copy(self)
        job.config = cfg
        return job

    def _fit(
        self,
        opened: OpenJob,
        started: float,
        data: Any,
        features_col: ColumnsSpec,
        label_col: str | Sequence[str],
        validation_data: Any,
        weight_col: str | None,
        callbacks: Sequence[Any] = (),
    ) -> TrainResult:
        cfg = self.config
        strategy = opened.strategy
        if weight_col:  # before any Spark job: can the loss take sample weights?
            check_weighted_loss(cfg.loss, dict(cfg.loss_kwargs))
        # The model, loss and optimizer are built while the driver waits on Spark's
        # data-preparation jobs: the first torch optimizer of a process imports
        # torch._dynamo (~1.5 s), time that would otherwise sit on the path to training.
        # Errors keep their order: data errors first, then the width check, then the
        # loss/optimizer settings.
        with ThreadPoolExecutor(1, thread_name_prefix="sparktrain-model") as pool:
            built = pool.submit(self._build_model)
            prepared = opened.prepare(
                data,
                validation_data,
                features_col,
                label_col,
                weight_col,
                lambda: None if built.exception() else takes_indices(built.result()[0]),
            )
            model, settings_error = built.result()
        layout = prepared.data_layout
        _check_layout_fits(layout, cfg, strategy.launcher)
        model, num_outputs = self.check_model(layout, model, settings_error, prepared.samples)
        check_param_cap(model, cfg)  # no-op for pipelines (each stage is checked instead)
        job = FitJob(
            spark=opened.env,
            prepared=prepared,
            model=model,
            model_fn=self.model_fn,
            model_kwargs=self.model_kwargs,
            config=cfg,
            num_outputs=num_outputs,
            started=started,
            fault=self._fault_plan,
            callbacks=tuple(callbacks),
        )
        if cfg.parallelism_pipeline > 1:
            result = run_pipeline(job, strategy)
        else:
            result = strategy.launch(job)
        result.summary["inputs"] = layout.to_dict()
        unscale_result(result, prepared)  # done by the stage runner and the rounds already
        return result

    # ------------------------------------------------------------------ internals
    def _build_model(self) -> tuple[nn.Module, Exception | None]:
        """Build the model once on the driver (seeded as the workers do) and try the loss
        and optimizer settings on it; their error, if any, is returned for
        :meth:`check_model` to raise after the width check."""
        cfg = self.config
        torch.manual_seed(cfg.seed)
        model = build_model(resolve_model_fn(self.model_fn, self.model_kwargs))
        try:
            build_loss(cfg.loss, dict(cfg.loss_kwargs))
            check_optimizer(cfg.optimizer, model.parameters(), cfg.lr, dict(cfg.optimizer_kwargs))
        except Exception as exc:
            return model, exc
        return model, None

    def check_model(
        self,
        layout: Layout | int,
        model: nn.Module,
        settings_error: Exception | None = None,
        samples: dict[str, bytes] | None = None,
    ) -> tuple[nn.Module, int]:
        """Does the driver's model take these inputs (``layout``, or a plain feature width;
        ``samples``: one raw value per binary column, to decode), and do the loss and
        optimizer settings fit it? Returns the model in training mode and its number of
        outputs; fails here, with the column and the fix, rather than in every task.
        :meth:`fit` calls it; the ml estimators call it to check labels before training."""
        cfg = self.config
        if isinstance(layout, int):
            layout = Layout.plain(layout)
        _check_float_inputs(layout, model)
        batch = sample_batch(layout, samples)
        model.eval()
        try:
            with torch.no_grad():
                out = forward(model, batch)
        except Exception as exc:
            if layout.is_plain:
                raise DataError(
                    f"the model does not accept features of width {layout.width} ({exc}); "
                    "check the features column or the model's input size"
                ) from exc
            ints = [c.key for c in layout.columns if c.dtype == "int64"]
            hint = (
                f" Integer columns ({', '.join(ints)}) arrive as int64 (ids, tokens); to feed "
                f"them to float layers set feature_dtypes={{{ints[0]!r}: 'float32'}}."
                if ints
                else ""
            )
            names, _ = forward_params(model)
            masked = [
                c.key for c in layout.columns if c.kind != RAGGED and f"{c.key}_mask" in names
            ]
            if masked:
                hint += (
                    f" forward() asks for {masked[0]}_mask: declare the column variable-length "
                    f"with feature_shapes={{{masked[0]!r}: [-1]}} to get a padded batch and "
                    "its mask."
                )
            raise DataError(
                f"the model does not accept a batch of its inputs ({type(exc).__name__}: "
                f"{exc}); the {layout.describe()}. Check features_col, feature_shapes and "
                f"the model's forward() arguments.{hint}"
            ) from exc
        if not isinstance(out, torch.Tensor):
            raise DataError(
                f"the model returned {type(out).__name__}; the built-in loop needs one output "
                "tensor of shape (batch, outputs)"
            )
        num_outputs = int(out.shape[1]) if out.ndim == 2 else 1
        if layout.label_width is not None:
            if cfg.loss == "cross_entropy":
                raise ConfigError(
                    f"loss='cross_entropy' takes one class index a row, but the labels "
                    f"({', '.join(layout.label_sources)}) hold {layout.label_width} values a "
                    "row: use bce_with_logits for multi-label or mse for multi-output"
                )
            if isinstance(cfg.loss, str) and num_outputs != layout.label_width:
                raise ConfigError(
                    f"the labels hold {layout.label_width} values a row but the model has "
                    f"{num_outputs} outputs; give the model one output per label"
                )
        if cfg.loss == "cross_entropy" and num_outputs < 2:
            raise ConfigError(
                f"loss='cross_entropy' needs one output per class, the model has {num_outputs}; "
                "use bce_with_logits for a single logit"
            )
        if settings_error is not None:
            raise settings_error
        return model.train(), num_outputs


def _check_layout_fits(layout: Layout, cfg: TrainConfig, launcher: str) -> None:
    """Pipelines and tree_aggregate take one float32 vector column and a scalar label."""
    if layout.is_plain:
        return
    if cfg.parallelism_pipeline > 1:
        where = f"pipeline parallelism (parallelism.pipeline={cfg.parallelism_pipeline})"
    elif launcher == "rounds":
        where = f"strategy={cfg.strategy!r}"
    else:
        return
    raise ConfigError(
        f"{where} trains on one float32 features vector and a scalar label; this fit's "
        f"{layout.describe()}. Use strategy='ring', 'tree' or 'ps' (data parallel) for "
        "several or typed columns, or assemble one float vector column (VectorAssembler)"
    )


def _check_float_inputs(layout: Layout, model: nn.Module) -> None:
    """A float column must arrive in the model's own float dtype, or say which option
    changes it."""
    dtypes = {p.dtype for p in model.parameters() if p.dtype.is_floating_point}
    if len(dtypes) != 1:
        return
    (model_dtype,) = dtypes
    name = str(model_dtype).removeprefix("torch.")
    if name not in ("float32", "float64"):  # half models cast their inputs themselves
        return
    for column in layout.columns:
        if column.dtype in ("float32", "float64") and column.dtype != name:
            raise DataError(
                f"column {column.source!r} arrives as {column.dtype} but the model's parameters "
                f"are {name}: set feature_dtypes={{{column.key!r}: {name!r}}} (or cast the "
                "model)"
            )


def takes_indices(model: nn.Module) -> str | None:
    """Why ``feature_scaling="auto"`` must leave ``model``'s features alone: an embedding
    layer's inputs are row indices, which scaling would turn into other rows."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding | nn.EmbeddingBag):
            return (
                f"the model's {name or 'root'} is an {type(module).__name__}, whose inputs are "
                "indices"
            )
    return None
