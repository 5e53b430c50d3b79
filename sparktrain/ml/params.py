"""Params of the sparktrain pyspark.ml stages, in the pyspark.ml style.

One ``Has<Name>`` mixin per param, each with a type converter and a default; the private
``_TorchParams`` collects them for both the estimators and their models (so a fitted model
carries the settings it was trained with). The standard column params (``featuresCol``,
``labelCol``, ``predictionCol``, ``probabilityCol``, ``rawPredictionCol``, ``weightCol``,
``seed``) are pyspark's own mixins, so evaluators and tuning see the usual names.
``weightCol`` (unset by default) passes the Trainer's ``weight_col``: sample weights
``>= 0`` that make the objective the weighted mean loss ``sum w_i l_i / sum w_i`` (MLlib's
convention); validation metrics stay unweighted.

Each param is one row of :data:`sparktrain.ml.paramgen.PARAMS`: the TrainConfig key it
sets (``learningRate -> lr``, ``maxEpochs -> epochs``, ``dataMemoryInMB ->
data_memory_mb``, otherwise the key in camelCase: ``batchSize -> batch_size``...), what
its converter checks, and its doc. The mixins, the estimators' setters and keyword
arguments are generated from the table into :mod:`sparktrain.ml.shared_params` (``python
-m sparktrain.ml.paramgen``) and re-exported here; :meth:`_TorchParams._train_config`
maps the params onto TrainConfig by the same table (a JSON param is parsed, ``metrics``
holds names only). ``modelFn``, ``modelKwargs`` and ``featuresCols`` set no TrainConfig
key; ``labelScaling`` (regressor) sets ``label_scaling`` only with ``loss="mse"``.

Defaults come from :data:`ML_DEFAULTS`: :class:`~sparktrain.config.TrainConfig`'s, except
``optimizer="adam"``, ``learningRate=0.001``, ``maxEpochs=50`` (and ``batchSize=32``,
TrainConfig's), chosen so that a model trains standardised tabular data well out of the
box (docs/ml.md has the table and why), and the regressor's ``loss="mse"`` and
``labelScaling=True``. A model keeps ``driverServicesHost``/``driverServicesPorts``: under
Spark Connect its ``transform`` serves large weights from there.

The converters check a value when it is set, with TrainConfig's wording under the
param's name; ``lrSchedule`` and ``earlyStopping`` are checked by TrainConfig itself, so
the two cannot disagree on what a schedule name or an early-stopping table is. ``metrics``
takes names only: a param must be JSON for MLlib metadata, so a callable metric goes
through :class:`~sparktrain.Trainer` (TrainConfig ``metrics``).

The model's inputs: ``featuresCol`` names one column (``model(x)``); ``featuresCols``, when
set and non-empty, overrides it with several columns, ``["a", "b"]`` for ``model(a, b)``
or ``["user=user_id", "item=item_id"]`` for ``model(user=..., item=...)`` (see
:mod:`sparktrain.data.columns`). A fit with only ``featuresCol`` and none of the four
per-column options is the *plain* fit of one float vector column.
"""

from __future__ import annotations

import json
from typing import Any

from sparktrain.config import LOSSES, TrainConfig
from sparktrain.data.columns import ColumnsSpec
from sparktrain.ml import shared_params
from sparktrain.ml.paramgen import ML_DEFAULTS, PARAMS, features_spec

# the generated Has<Name> mixins, re-exported: `from sparktrain.ml.params import HasLoss`
from sparktrain.ml.shared_params import *  # noqa: F403
from sparktrain.ml.shared_params import (
    _TorchClassifierParamsBase,
    _TorchParamsBase,
    _TorchRegressorParamsBase,
)

__all__ = ["ML_DEFAULTS"]
__all__ += shared_params.__all__

CLASSIFICATION_LOSSES = ("cross_entropy", "bce_with_logits")
REGRESSION_LOSSES = tuple(loss for loss in LOSSES if loss not in CLASSIFICATION_LOSSES)

# The params every stage maps onto TrainConfig, and the getter that reads each.
_CONFIG_PARAMS = [spec for spec in PARAMS if spec.key and spec.stage == "all"]


class _TorchParams(_TorchParamsBase):
    """Params shared by :class:`TorchEstimator` and :class:`TorchModel`."""

    def _train_config(self) -> TrainConfig:
        """The TrainConfig these params describe (validated: a bad value is a ConfigError
        naming the TrainConfig key)."""
        cfg = ML_DEFAULTS.replace(
            **{
                spec.key: spec.kind.to_config(getattr(self, spec.getter)())
                for spec in _CONFIG_PARAMS
            }
        )
        # the keys the user set, as against defaults: what a fit's changed-defaults
        # notice reads (a learningRate set for SGD, which now runs under Adam)
        return cfg.given_only({spec.key for spec in _CONFIG_PARAMS if self.isSet(spec.name)})

    def getModelKwargsDict(self) -> dict[str, Any]:
        """modelKwargs parsed into a dict."""
        parsed: dict[str, Any] = json.loads(self.getModelKwargs())
        return parsed

    def _column_options(self) -> dict[str, dict[str, Any]]:
        """The per-column options as TrainConfig keys (empty tables when unset)."""
        return {
            "feature_shapes": json.loads(self.getFeatureShapes()),
            "feature_dtypes": json.loads(self.getFeatureDtypes()),
            "decode": json.loads(self.getDecode()),
            "collate": json.loads(self.getCollate()),
        }

    def _features_spec(self) -> tuple[ColumnsSpec, str]:
        """(the ``features_col`` these params describe, the param that gives it):
        ``featuresCols`` when set and non-empty, else ``featuresCol``."""
        spec = features_spec(self.getFeaturesCols())
        if spec is not None:
            return spec, "featuresCols"
        return self.getFeaturesCol(), "featuresCol"

    def _is_plain_fit(self) -> bool:
        """Only ``featuresCol`` and no per-column option: one float vector column."""
        return not self.getFeaturesCols() and not any(self._column_options().values())


class _TorchClassifierParams(_TorchParams, _TorchClassifierParamsBase):
    """Params of :class:`TorchClassifier` and :class:`TorchClassificationModel`."""


class _TorchRegressorParams(_TorchParams, _TorchRegressorParamsBase):
    """Params of :class:`TorchRegressor` and :class:`TorchRegressionModel`."""

    def _train_config(self) -> TrainConfig:
        """:meth:`_TorchParams._train_config` plus ``label_scaling``: ``labelScaling``
        applies to ``loss="mse"`` only (TrainConfig refuses it for other losses)."""
        scaling = self.getLabelScaling() and self.getLoss() == "mse"
        return super()._train_config().replace(label_scaling=scaling)
