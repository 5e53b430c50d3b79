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
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from sparktrain import strategies
from sparktrain.builders import (
    ModelFn,
    build_loss,
    build_model,
    build_optimizer,
    check_weighted_loss,
    resolve_model_fn,
)
from sparktrain.config import TrainConfig
from sparktrain.errors import ConfigError, DataError
from sparktrain.launch.prepare import prepare
from sparktrain.launch.resources import check_can_launch, check_transport_security
from sparktrain.launch.stage import FitJob
from sparktrain.parallel.pipeline import check_param_cap, run_pipeline
from sparktrain.result import TrainResult
from sparktrain.worker.faults import FaultPlan

if TYPE_CHECKING:
    from pyspark import SparkContext
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
        self.config.validate()  # the config's own keys, then its strategy's view of them
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
        strategy = strategies.get(cfg.strategy)
        if strategy.launcher == "barrier" or cfg.parallelism_pipeline > 1:
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
        check_param_cap(model, cfg)  # no-op for pipelines (each stage is checked instead)
        job = FitJob(
            sc=sc,
            prepared=prepared,
            model=model,
            model_fn=self.model_fn,
            model_kwargs=self.model_kwargs,
            config=cfg,
            num_outputs=num_outputs,
            started=started,
            fault=self._fault_plan,
        )
        if cfg.parallelism_pipeline > 1:
            return run_pipeline(job, strategy)
        return strategy.launch(job)

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
