"""Opening a job on the driver: the one place every way in (``Trainer.fit``,
:func:`sparktrain.run`, :func:`sparktrain.torch_run`, the estimators through the Trainer)
resolves the strategy, runs its checks, finds the session and prepares the data.

:class:`~sparktrain.config.TrainConfig` checks its own fields only; what a strategy makes
of them (a compression spec it cannot take, a device it has no path for, a loop it cannot
run) is asked of the plug-in here, in :func:`check_job`, before any Spark work.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from sparktrain.config import TrainConfig, changed_defaults_notice
from sparktrain.data.columns import ColumnsSpec, parse_columns, parse_labels
from sparktrain.driver.prepare import ColumnOptions, FeaturesVeto, PreparedData, prepare
from sparktrain.driver.resources import check_can_launch, check_transport_security
from sparktrain.driver.spark_env import SparkEnv, check_data_kind, session_of, spark_env
from sparktrain.errors import ConfigError, DefaultsChangedWarning
from sparktrain.strategies import registry

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from sparktrain.strategies.base import Strategy

Way = Literal["fit", "run", "torch_run"]
"""How the user came in: ``Trainer.fit`` (the built-in loop), ``run(train_fn)`` (their
own loop on the strategy) or ``torch_run(fn)`` (their own DDP code; the ranks only meet)."""


def check_job(cfg: TrainConfig, way: Way = "fit") -> Strategy:
    """The strategy ``cfg`` names, after it and ``way`` accepted the config: a
    :class:`~sparktrain.errors.ConfigError` that says what to change otherwise. Needs no
    Spark: the CLI and the Trainer call it before a session starts."""
    strategy = registry.get(cfg.strategy)  # an unknown name: the error lists them
    if way == "run" and not strategy.supports_run:
        can = registry.having("supports_run")
        others = [n for n in registry.names() if n not in can]
        raise ConfigError(
            f"sparktrain.run trains with strategy={registry.spelled(can)}, not "
            f"{cfg.strategy!r}: {registry.spelled(others)} stay with Trainer.fit"
        )
    if way == "torch_run" and not strategy.supports_torch_run:
        raise ConfigError(
            f"torch_run meets the ranks over strategy="
            f"{registry.spelled(registry.having('supports_torch_run'))}, not "
            f"{cfg.strategy!r}: fn does its own communication"
        )
    if way != "fit":
        if cfg.parallelism_pipeline > 1:
            raise ConfigError(
                f"sparktrain.{way} is data parallel: pipeline parallelism stays with "
                "Trainer.fit (set parallelism.pipeline = 1)"
            )
        if cfg.compression == "auto":
            raise ConfigError(
                f"compression='auto' probes a model the driver knows; with sparktrain.{way} "
                "name a spec (e.g. 'int8+ef') or 'none'"
            )
    strategy.validate(cfg)
    return strategy


@dataclass(frozen=True)
class OpenJob:
    """A checked job in a session: the session, its Spark, the config (as the encryption
    gate left it) and the strategy."""

    session: SparkSession
    env: SparkEnv
    config: TrainConfig
    strategy: Strategy
    way: Way = "fit"

    def prepare(
        self,
        data: Any,
        validation_data: Any,
        columns: ColumnsSpec,
        label_col: str | Sequence[str],
        weight_col: str | None,
        features_veto: FeaturesVeto | None = None,
    ) -> PreparedData:
        """Repartition ``data`` over the workers with the validation split, in the
        column layout the config's column options give (``features_veto``: see
        :func:`~sparktrain.driver.prepare.prepare`)."""
        cfg = self.config
        return prepare(
            data,
            validation_data,
            columns,
            label_col,
            cfg.num_workers,
            weight_col,
            ColumnOptions.of(cfg),
            *self.scaling(),
            features_veto,
        )

    def scaling(self) -> tuple[bool | str, bool | str]:
        """``(label_scaling, feature_scaling)`` as this way in applies them: ``"auto"``
        scales labels for an mse fit and features for a fit (where the data allows),
        nothing under ``run()``, whose function builds its own model."""
        cfg = self.config
        labels, features = cfg.label_scaling, cfg.feature_scaling
        if labels == "auto":
            labels = "auto" if self.way == "fit" and cfg.loss == "mse" else False
        if features == "auto" and self.way != "fit":
            features = False
        return labels, features


def open_job(
    cfg: TrainConfig,
    data: Any,
    validation_data: Any = None,
    *,
    way: Way = "fit",
    spark: SparkSession | None = None,
    columns: ColumnsSpec | None = None,
    label_col: str | Sequence[str] = "label",
) -> OpenJob:
    """Check ``cfg`` for ``way``, check the column specs (when there is data), find the
    session (``spark``, else the one ``data`` belongs to, else the active one), check the
    data's kind, pass the encryption gate and, for a barrier stage, that the cluster has
    the slots. Every failure comes before any Spark job. A fit whose top-k with ``+ef``
    meets SGD momentum gets the momentum moved into the compressor
    (:mod:`sparktrain.compress.correction`; logged once)."""
    strategy = check_job(cfg, way)
    if way == "fit":  # the built-in loop's optimizer: top-k+ef takes its momentum (DGC)
        from sparktrain.compress.correction import apply_momentum_correction

        cfg = apply_momentum_correction(cfg)
    if columns is not None:
        parse_columns(columns)
        parse_labels(label_col)
    session = spark or session_of(data)
    if session is None:
        from sparktrain.session import get_or_create_session

        session = get_or_create_session()
    env = spark_env(session)
    check_data_kind(env, data, validation_data)
    # The encryption gate, before anything else and for every path (ring, tree, ps, auto,
    # pipelines, tree_aggregate's delta+ weights server). Under Spark's wire encryption it
    # may force frame integrity on: the job then holds an adjusted copy of the config.
    cfg = check_transport_security(env, cfg)
    if strategy.launcher == "barrier" or cfg.parallelism_pipeline > 1:
        check_can_launch(env, cfg.num_workers)
    if way == "fit":
        announce_changed_defaults(cfg)
    return OpenJob(session=session, env=env, config=cfg, strategy=strategy, way=way)


_ANNOUNCED: set[str] = set()


def announce_changed_defaults(cfg: TrainConfig) -> None:
    """Say once a process (a :class:`~sparktrain.errors.DefaultsChangedWarning`) which
    changed defaults a fit runs on; set the keys, or filter the warning, to silence it."""
    notice = changed_defaults_notice(cfg)
    # a rate given for SGD is said even after the general notice was
    kind = "lr" if notice.startswith("lr=") else "defaults"
    if notice and kind not in _ANNOUNCED:
        _ANNOUNCED.add(kind)
        warnings.warn(notice, DefaultsChangedWarning, stacklevel=4)
