"""sparktrain as pyspark.ml stages: Estimators that train torch models with the
:class:`~sparktrain.Trainer` and Models that run distributed batch inference.

>>> from sparktrain.ml import TorchClassifier
>>> clf = TorchClassifier(modelFn="sparktrain.models:digits_mlp", maxEpochs=10)
>>> model = clf.fit(train)  # doctest: +SKIP
>>> model.transform(test).select("prediction", "probability")  # doctest: +SKIP
"""

from sparktrain.ml.allowlist import allow_model_modules, allowed_model_modules
from sparktrain.ml.estimator import TorchClassifier, TorchEstimator, TorchRegressor
from sparktrain.ml.model import TorchClassificationModel, TorchModel, TorchRegressionModel
from sparktrain.ml.stage_loading import load_stage

__all__ = [
    "TorchClassificationModel",
    "TorchClassifier",
    "TorchEstimator",
    "TorchModel",
    "TorchRegressionModel",
    "TorchRegressor",
    "allow_model_modules",
    "allowed_model_modules",
    "load_stage",
]
