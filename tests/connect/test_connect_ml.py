"""sparktrain.ml from a Spark Connect session: a Pipeline (VectorAssembler, StandardScaler
and TorchClassifier) fits, transforms (the weights travel in the plan), saves and loads
with identical predictions, in the on-disk format of a classic session."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from pyspark.ml import Pipeline, PipelineModel
from pyspark.ml.evaluation import MulticlassClassificationEvaluator

from sparktrain.ml import TorchClassificationModel, TorchClassifier

from .fixtures import DIGITS_MODEL, digits_pipeline_of, pixel_frames

pytestmark = [pytest.mark.connect, pytest.mark.timeout(300)]


def _predictions(model, frame):  # type: ignore[no-untyped-def]
    return model.transform(frame).select("id", "prediction", "probability").orderBy("id").collect()


def test_pipeline_fit_transform_save_and_load(connect_spark, tmp_path: Path):  # type: ignore[no-untyped-def]
    train, test = pixel_frames(connect_spark)
    pipeline = digits_pipeline_of(numWorkers=2)
    clf = pipeline.getStages()[-1]
    model = pipeline.fit(train)
    out = model.transform(test)
    assert MulticlassClassificationEvaluator(metricName="accuracy").evaluate(out) >= 0.95
    assert out.count() == test.count()

    before = _predictions(model, test)
    model.write().overwrite().save(str(tmp_path / "pipeline_model"))
    model.write().overwrite().save(str(tmp_path / "pipeline_model"))  # overwrite under Connect
    loaded = PipelineModel.load(str(tmp_path / "pipeline_model"))
    assert isinstance(loaded.stages[-1], TorchClassificationModel)
    after = _predictions(loaded, test)
    assert [r.prediction for r in before] == [r.prediction for r in after]
    assert all(
        np.array_equal(x.probability, y.probability) for x, y in zip(before, after, strict=True)
    )

    # the model alone, at a file: URI: classic MLlib metadata + torch.save weights
    torch_model = model.stages[-1]
    path = tmp_path / "model"
    torch_model.write().overwrite().save(path.as_uri())
    meta = json.loads(next((path / "metadata").glob("part-*")).read_text())
    assert meta["class"] == "sparktrain.ml.model.TorchClassificationModel"
    assert meta["numClasses"] == 10 and meta["weightsFile"] == "data/weights.pt"
    state = torch.load(path / "data" / "weights.pt", weights_only=True)
    assert set(state) == set(torch_model.getModule().state_dict())
    reloaded = TorchClassificationModel.load(str(path))
    assert reloaded.uid == torch_model.uid and reloaded.getFeaturesCol() == "scaled"

    # the estimator and the unfitted pipeline: params only
    clf.write().overwrite().save(str(tmp_path / "estimator"))
    assert TorchClassifier.load(str(tmp_path / "estimator")).getMaxEpochs() == 10
    pipeline.write().overwrite().save(str(tmp_path / "pipeline"))
    again = Pipeline.load(str(tmp_path / "pipeline")).getStages()[-1]
    assert isinstance(again, TorchClassifier) and again.getModelFn() == DIGITS_MODEL
