"""sparktrain.ml on local[2]: Pipelines, evaluators, tuning, persistence and errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
from pyspark.ml import Pipeline, PipelineModel
from pyspark.ml.evaluation import (
    BinaryClassificationEvaluator,
    MulticlassClassificationEvaluator,
    RegressionEvaluator,
)
from pyspark.ml.feature import VectorAssembler
from pyspark.ml.linalg import SparseVector, Vectors, VectorUDT
from pyspark.ml.tuning import CrossValidator, ParamGridBuilder, TrainValidationSplit
from pyspark.sql.types import DoubleType

from sparktrain.errors import ConfigError, DataError
from sparktrain.ml import (
    TorchClassificationModel,
    TorchClassifier,
    TorchRegressionModel,
    TorchRegressor,
)

from .fixtures import DIGITS_MODEL, PIXELS, digits, digits_pipeline_of, pixel_frames

pytestmark = [pytest.mark.spark, pytest.mark.timeout(600)]


def assembled(frame):  # type: ignore[no-untyped-def]
    return VectorAssembler(inputCols=PIXELS, outputCol="features").transform(frame)


@pytest.fixture(scope="module")
def digits_pipeline(_sessions):  # type: ignore[no-untyped-def]
    """VectorAssembler -> StandardScaler -> TorchClassifier, fitted once for the module."""
    spark = _sessions.get("local[2]")
    train, test = pixel_frames(spark)
    pipeline = digits_pipeline_of()
    return pipeline, pipeline.fit(train), train, test


def test_pipeline_on_digits_reaches_95_percent(spark, digits_pipeline):  # type: ignore[no-untyped-def]
    _, model, _, test = digits_pipeline
    out = model.transform(test)
    assert MulticlassClassificationEvaluator(metricName="accuracy").evaluate(out) >= 0.95
    assert MulticlassClassificationEvaluator(metricName="f1").evaluate(out) >= 0.9
    # MLlib's output types, every input column kept, one output row per input row
    schema = out.schema
    assert isinstance(schema["prediction"].dataType, DoubleType)
    assert isinstance(schema["probability"].dataType, VectorUDT)
    assert isinstance(schema["rawPrediction"].dataType, VectorUDT)
    assert out.columns[: len(test.columns)] == test.columns
    assert out.count() == test.count()
    row = out.select("probability", "rawPrediction", "prediction").first()
    assert row is not None
    assert len(row.probability) == 10 and sum(row.probability) == pytest.approx(1.0)
    assert row.prediction == float(np.argmax(row.rawPrediction.toArray()))
    torch_model = model.stages[-1]
    assert isinstance(torch_model, TorchClassificationModel)
    assert torch_model.numClasses == 10 and torch_model.numFeatures == 64
    assert torch_model.hasSummary and torch_model.summary["strategy"] == "ring"
    # output columns can be switched off, as in MLlib
    slim = torch_model.copy({torch_model.rawPredictionCol: "", torch_model.probabilityCol: ""})
    assert (
        "rawPrediction"
        not in slim.transform(model.stages[1].transform(model.stages[0].transform(test))).columns
    )


def test_pipeline_model_save_load_gives_identical_predictions(  # type: ignore[no-untyped-def]
    spark, digits_pipeline, tmp_path
):
    pipeline, model, _, test = digits_pipeline
    before = model.transform(test).select("id", "prediction", "probability").orderBy("id")
    model.write().overwrite().save(str(tmp_path / "pipeline_model"))
    loaded = PipelineModel.load(str(tmp_path / "pipeline_model"))
    assert isinstance(loaded.stages[-1], TorchClassificationModel)
    after = loaded.transform(test).select("id", "prediction", "probability").orderBy("id")
    a, b = before.collect(), after.collect()
    assert [r.prediction for r in a] == [r.prediction for r in b]
    assert all(np.array_equal(x.probability, y.probability) for x, y in zip(a, b, strict=True))

    # the model alone: MLlib metadata + a weights file torch reads with weights_only=True
    torch_model = model.stages[-1]
    path = tmp_path / "model"
    torch_model.save(str(path))
    meta = json.loads(next((path / "metadata").glob("part-*")).read_text())
    assert meta["class"] == "sparktrain.ml.model.TorchClassificationModel"
    assert meta["paramMap"]["modelFn"] == DIGITS_MODEL and meta["numClasses"] == 10
    import torch

    state = torch.load(path / "data" / "weights.pt", weights_only=True)
    assert set(state) == set(torch_model.getModule().state_dict())
    reloaded = TorchClassificationModel.load(str(path))
    assert reloaded.uid == torch_model.uid and not reloaded.hasSummary
    assert reloaded.getLearningRate() == 0.003 and reloaded.getFeaturesCol() == "scaled"
    scaled = model.stages[1].transform(model.stages[0].transform(test))
    x = reloaded.transform(scaled).select("id", "rawPrediction").orderBy("id").collect()
    y = torch_model.transform(scaled).select("id", "rawPrediction").orderBy("id").collect()
    assert all(np.array_equal(p.rawPrediction, q.rawPrediction) for p, q in zip(x, y, strict=True))

    # the estimator and the unfitted pipeline: params only
    pipeline.write().overwrite().save(str(tmp_path / "pipeline"))
    clf = Pipeline.load(str(tmp_path / "pipeline")).getStages()[-1]
    assert isinstance(clf, TorchClassifier)
    assert clf.getModelFn() == DIGITS_MODEL and clf.getOptimizer() == "adam"
    assert clf.getMaxEpochs() == 10 and clf.getFeaturesCol() == "scaled"


def test_switched_off_columns_are_left_out_and_predictions_unchanged(  # type: ignore[no-untyped-def]
    digits_pipeline, monkeypatch
):
    """probabilityCol="" and rawPredictionCol="": those columns are left out and the
    classes are the same; the UDF returns the model's outputs either way (the columns
    are expressions over them: tests/integration/test_ml_pruning.py)."""
    from pyspark.sql import functions as F

    returns = []
    real_udf = F.arrow_udf

    def recording(fn, return_type):  # type: ignore[no-untyped-def]
        returns.append(return_type)
        return real_udf(fn, return_type)

    monkeypatch.setattr(F, "arrow_udf", recording)
    _, model, _, test = digits_pipeline
    scaled = model.stages[1].transform(model.stages[0].transform(test))
    torch_model = model.stages[-1]
    lean = torch_model.copy().setProbabilityCol("").setRawPredictionCol("")
    out = lean.setPredictionCol("lean").transform(scaled)
    assert "probability" not in out.columns and "rawPrediction" not in out.columns
    assert returns == ["array<double>"]
    both = torch_model.transform(out).select("lean", "prediction").collect()
    assert len(both) == test.count()
    assert all(r.lean == r.prediction for r in both)


def test_binary_classifier_on_sparse_vectors(spark):  # type: ignore[no-untyped-def]
    """One logit with bce_with_logits, sparse input vectors, the tree strategy."""
    split = digits()

    def sparse_frame(x: np.ndarray, y: np.ndarray):  # type: ignore[no-untyped-def]
        rows = []
        for features, digit in zip(x, y, strict=True):
            nz = np.flatnonzero(features)
            rows.append((Vectors.sparse(64, nz.tolist(), features[nz].tolist()), float(digit >= 5)))
        return spark.createDataFrame(rows, ["features", "label"]).repartition(2)

    train, test = (
        sparse_frame(split.x_train, split.y_train),
        sparse_frame(split.x_test, split.y_test),
    )
    first = train.first()
    assert first is not None and isinstance(first.features, SparseVector)
    clf = TorchClassifier(
        modelFn="sparktrain.models:mlp",
        modelKwargs={"in_features": 64, "hidden": [32], "out_features": 1},
        loss="bce_with_logits",
        optimizer="adam",
        learningRate=0.01,
        maxEpochs=5,
        strategy="tree",
    )
    model = clf.fit(train)
    assert model.numClasses == 2
    out = model.transform(test)
    assert BinaryClassificationEvaluator(metricName="areaUnderROC").evaluate(out) >= 0.95
    assert MulticlassClassificationEvaluator(metricName="accuracy").evaluate(out) >= 0.85
    row = out.first()
    assert row is not None and len(row.probability) == 2 and len(row.rawPrediction) == 2


def test_regressor_on_diabetes_beats_the_mean(spark, tmp_path):  # type: ignore[no-untyped-def]
    """array<double> features; RMSE below predicting the training mean."""
    from sklearn.datasets import load_diabetes
    from sklearn.model_selection import train_test_split

    x, y = load_diabetes(return_X_y=True)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.25, random_state=0)

    def frame(xs: np.ndarray, ys: np.ndarray):  # type: ignore[no-untyped-def]
        rows = [(r.tolist(), float(t)) for r, t in zip(xs, ys, strict=True)]
        return spark.createDataFrame(rows, "features array<double>, label double").repartition(2)

    train, test = frame(xtr, ytr), frame(xte, yte)
    reg = TorchRegressor(
        modelFn="sparktrain.models:mlp",
        modelKwargs={"in_features": 10, "hidden": [32], "out_features": 1},
        optimizer="adam",
        learningRate=0.1,
        maxEpochs=10,
        labelScaling=False,  # raw labels, as before label scaling (test_ml_defaults: on)
    )
    model = reg.fit(train)
    assert isinstance(model, TorchRegressionModel)
    out = model.transform(test)
    assert isinstance(out.schema["prediction"].dataType, DoubleType)
    assert model.labelStats is None and "label_scaling" not in model.summary
    rmse = RegressionEvaluator(metricName="rmse").evaluate(out)
    baseline = float(np.sqrt(np.mean((yte - ytr.mean()) ** 2)))
    assert rmse < 0.9 * baseline, (rmse, baseline)
    model.save(str(tmp_path / "reg"))
    again = TorchRegressionModel.load(str(tmp_path / "reg")).transform(test)
    assert RegressionEvaluator(metricName="rmse").evaluate(again) == rmse


def test_cross_validator_over_learning_rate_and_strategy(spark):  # type: ignore[no-untyped-def]
    train, test = pixel_frames(spark)
    train, test = assembled(train), assembled(test)
    clf = TorchClassifier(
        modelFn=DIGITS_MODEL, optimizer="adam", learningRate=0.01, maxEpochs=3, batchSize=64
    )
    # two maps that differ in both params (2 folds x 2 maps + the refit: 5 fits, not 9);
    # the winner's strategy is not the estimator's own, so it must come from the grid
    grid = [
        {clf.learningRate: 0.0003, clf.strategy: "ring"},
        {clf.learningRate: 0.01, clf.strategy: "tree"},
    ]
    evaluator = MulticlassClassificationEvaluator(metricName="accuracy")
    cv = CrossValidator(
        estimator=clf, estimatorParamMaps=grid, evaluator=evaluator, numFolds=2, seed=1
    )
    cv_model = cv.fit(train)
    assert len(cv_model.avgMetrics) == 2
    best = cv_model.bestModel
    assert isinstance(best, TorchClassificationModel)
    winner = grid[int(np.argmax(cv_model.avgMetrics))]
    assert best.getLearningRate() == winner[clf.learningRate] == 0.01
    assert best.getStrategy() == winner[clf.strategy] == "tree"
    assert clf.getLearningRate() == 0.01 and clf.getStrategy() == "ring"  # untouched
    assert evaluator.evaluate(cv_model.transform(test)) >= 0.85


def test_train_validation_split_over_compression(spark):  # type: ignore[no-untyped-def]
    train, _ = pixel_frames(spark)
    train = assembled(train)
    clf = TorchClassifier(modelFn=DIGITS_MODEL, optimizer="adam", maxEpochs=2, batchSize=64)
    grid = (
        ParamGridBuilder()
        .addGrid(clf.compression, ["none"])
        .addGrid(clf.learningRate, [0.01])
        .build()
    )
    tvs = TrainValidationSplit(
        estimator=clf,
        estimatorParamMaps=grid,
        evaluator=MulticlassClassificationEvaluator(metricName="accuracy"),
        trainRatio=0.75,
        seed=3,
    )
    model = tvs.fit(train)
    assert len(model.validationMetrics) == 1 and model.validationMetrics[0] > 0.5
    assert model.bestModel.getCompression() == "none"


def test_clear_errors(spark):  # type: ignore[no-untyped-def]
    train, _ = pixel_frames(spark)
    vectors = assembled(train)
    clf = TorchClassifier(modelFn=DIGITS_MODEL, maxEpochs=1)
    with pytest.raises(DataError, match="no features column 'features' \\(featuresCol\\)"):
        clf.fit(train)
    with pytest.raises(DataError, match="no label column 'target' \\(labelCol\\)"):
        clf.copy({clf.labelCol: "target"}).fit(vectors)
    halves = vectors.withColumn("label", vectors["label"] / 2)
    with pytest.raises(DataError, match="integral class indices 0..9.*not whole numbers"):
        clf.fit(halves)
    shifted = vectors.withColumn("label", vectors["label"] + 5)
    with pytest.raises(DataError, match="found labels in \\[5, 14\\]"):
        clf.fit(shifted)
    with pytest.raises(ConfigError, match="modelFn 'no_such_package.models:net': cannot import"):
        TorchClassifier(modelFn="no_such_package.models:net").fit(vectors)
    with pytest.raises(ConfigError, match="has no attribute 'nope'"):
        TorchClassifier(modelFn="sparktrain.models:nope").fit(vectors)
    with pytest.raises(DataError, match="does not accept features of width 64"):
        TorchClassifier(modelFn="sparktrain.models:mlp", modelKwargs={"in_features": 3}).fit(
            vectors
        )
    model = TorchClassificationModel()._set_state(b"x", num_features=64, num_outputs=10)
    model._set(modelFn=DIGITS_MODEL)
    with pytest.raises(DataError, match="no features column 'features'"):
        model.transform(train)
    with pytest.raises(DataError, match="'label' already exists"):
        model.setPredictionCol("label").transform(vectors)


def test_parameter_server_strategy(spark):  # type: ignore[no-untyped-def]
    train, test = pixel_frames(spark)
    clf = TorchClassifier(
        modelFn=DIGITS_MODEL,
        strategy="ps",
        psMode="sync",
        optimizer="adam",
        learningRate=0.003,
        maxEpochs=3,
    )
    model = clf.fit(assembled(train))
    accuracy = MulticlassClassificationEvaluator(metricName="accuracy").evaluate(
        model.transform(assembled(test))
    )
    assert accuracy >= 0.85 and model.summary["strategy"] == "ps"


def test_tree_aggregate_strategy(spark):  # type: ignore[no-untyped-def]
    train, test = pixel_frames(spark)
    clf = TorchClassifier(
        modelFn=DIGITS_MODEL,
        strategy="tree_aggregate",
        optimizer="adam",
        learningRate=0.003,
        maxEpochs=3,
        batchSize=64,
    )
    model = clf.fit(assembled(train))
    accuracy = MulticlassClassificationEvaluator(metricName="accuracy").evaluate(
        model.transform(assembled(test))
    )
    assert accuracy >= 0.85 and model.summary["strategy"] == "tree_aggregate"


# ------------------------------------------------------------------ sample weights
def _weighted(frame, weight):  # type: ignore[no-untyped-def]
    from pyspark.sql import functions as F

    return assembled(frame).withColumn("w", weight(F.col("label")).cast("double"))


def _class_share(model, frame, label: float) -> float:  # type: ignore[no-untyped-def]
    predictions = model.transform(assembled(frame)).select("prediction").toPandas()
    return float((predictions["prediction"] == label).mean())


def test_equal_weights_give_the_unweighted_model_with_ps(spark):  # type: ignore[no-untyped-def]
    from pyspark.sql import functions as F

    train, test = pixel_frames(spark)
    clf = TorchClassifier(
        modelFn=DIGITS_MODEL,
        strategy="ps",
        optimizer="adam",
        learningRate=0.01,
        maxEpochs=1,
        batchSize=128,
        weightCol="w",
    )
    doubled = clf.fit(_weighted(train, lambda y: F.lit(2.0)))
    assert doubled.getWeightCol() == "w" and doubled.summary["strategy"] == "ps"
    # the unweighted reference on the ring: a sync parameter server takes the ring's steps
    plain = clf.copy({clf.weightCol: "", clf.strategy: "ring"}).fit(assembled(train))
    a, b = plain.getModule().state_dict(), doubled.getModule().state_dict()
    for name in a:  # weights 2.0 are normalised to 1.0: the same objective, same seed
        np.testing.assert_allclose(b[name].numpy(), a[name].numpy(), rtol=0, atol=1e-4)
    assert doubled.summary["final_loss"] == pytest.approx(plain.summary["final_loss"], rel=1e-4)
    # unweighted, the model predicts 3 about as often as 3 occurs (a tenth of the digits)
    assert _class_share(plain, test, 3.0) > 0.05


def test_zero_weight_on_a_class_with_tree_aggregate(spark):  # type: ignore[no-untyped-def]
    from pyspark.sql import functions as F

    train, test = pixel_frames(spark)
    clf = TorchClassifier(
        modelFn=DIGITS_MODEL,
        strategy="tree_aggregate",
        optimizer="adam",
        learningRate=0.01,
        maxEpochs=2,
        batchSize=128,
        weightCol="w",
    )
    model = clf.fit(_weighted(train, lambda y: F.when(y == 3, 0.0).otherwise(1.0)))
    # rows of class 3 weigh nothing: the model (almost) never predicts 3...
    assert _class_share(model, test, 3.0) < 0.01
    # ...and still learns the other nine classes
    scored = model.transform(assembled(test)).where("label != 3")
    accuracy = MulticlassClassificationEvaluator(metricName="accuracy").evaluate(scored)
    assert accuracy > 0.85 and model.summary["strategy"] == "tree_aggregate"


def test_bad_weight_columns_fail_before_training(spark):  # type: ignore[no-untyped-def]
    from pyspark.sql import functions as F

    from sparktrain import TrainConfig, Trainer

    train, _ = pixel_frames(spark)
    vectors = assembled(train)
    clf = TorchClassifier(modelFn=DIGITS_MODEL, maxEpochs=1, weightCol="w")
    with pytest.raises(DataError, match="no weight column 'w' \\(weightCol\\)"):
        clf.fit(vectors)
    with pytest.raises(DataError, match="'w' \\(weightCol\\) has type string.*numeric"):
        clf.fit(vectors.withColumn("w", F.lit("heavy")))
    cases = {
        "negative weight": F.when(F.col("label") == 1, -1.0).otherwise(1.0),
        "null, NaN or infinite weight": F.when(F.col("label") == 2, float("nan")).otherwise(1.0),
        "every weight is 0": F.lit(0.0),
    }
    for needle, weight in cases.items():
        with pytest.raises(DataError, match=needle):
            clf.fit(vectors.withColumn("w", weight))
    inf = vectors.withColumn("w", F.when(F.col("label") == 2, float("inf")).otherwise(1.0))
    with pytest.raises(DataError, match="infinite"):
        clf.fit(inf)
    trainer = Trainer(DIGITS_MODEL, TrainConfig(epochs=1, progress=False), spark=spark)
    with pytest.raises(DataError, match="weight_col='w' needs a DataFrame"):
        trainer.fit(vectors.rdd.map(lambda r: (r.features.toArray(), r.label)), weight_col="w")

    def sum_of_squares(out, target):  # type: ignore[no-untyped-def]
        return ((out - target) ** 2).sum()

    custom = Trainer(
        DIGITS_MODEL, TrainConfig(epochs=1, loss=sum_of_squares, progress=False), spark=spark
    )
    with pytest.raises(ConfigError, match="cannot take sample weights.*reduction"):
        custom.fit(vectors.withColumn("w", F.lit(1.0)), weight_col="w")


# ------------------------------------------------------------------ typed inputs
USER_MODEL = "tests.unit.user_models:user_context"
ID_BASE = 1 << 25  # above 2**24: float32 would merge neighbouring ids, and their labels
USERS = 300
CONTEXT = "SELECT *, array(c0, c1, c2, c3) AS context FROM __THIS__"


def user_frames(spark):  # type: ignore[no-untyped-def]
    """An int64 id above 2**24 and four double context values a row; the label is the
    parity of the id's index, so only the exact id tells it. Three rows of each id train,
    the fourth tests."""
    import pandas as pd

    rng = np.random.default_rng(0)
    j = np.repeat(np.arange(USERS), 4)
    pdf = pd.DataFrame(rng.normal(size=(len(j), 4)), columns=["c0", "c1", "c2", "c3"])
    pdf.insert(0, "user_id", (ID_BASE + j).astype(np.int64))
    pdf.insert(0, "id", np.arange(len(j)))
    pdf["label"] = (j % 2).astype(np.float64)
    held_out = np.tile([False, False, False, True], USERS)
    train = spark.createDataFrame(pdf[~held_out]).repartition(2)
    return train, spark.createDataFrame(pdf[held_out])


def user_classifier(**params):  # type: ignore[no-untyped-def]
    settings = {"optimizer": "adam", "learningRate": 0.05, "maxEpochs": 8, "batchSize": 32}
    return TorchClassifier(
        modelFn=USER_MODEL,
        featuresCols={"user": "user_id", "context": "context"},
        **{**settings, **params},
    )


def test_keyword_inputs_train_transform_save_and_load_in_a_pipeline(  # type: ignore[no-untyped-def]
    spark, tmp_path, monkeypatch
):
    from pyspark.ml.feature import SQLTransformer

    from sparktrain.ml import allowlist

    train, test = user_frames(spark)
    pipeline = Pipeline(stages=[SQLTransformer(statement=CONTEXT), user_classifier()])
    model = pipeline.fit(train)
    torch_model = model.stages[-1]
    assert isinstance(torch_model, TorchClassificationModel)
    layout = torch_model.layout
    assert layout.call == "keyword" and not layout.is_plain
    assert [(c.key, c.source, c.dtype) for c in layout.columns] == [
        ("user", "user_id", "int64"),
        ("context", "context", "float32"),
    ]
    assert torch_model.summary["inputs"] == layout.to_dict()
    assert torch_model.numFeatures == 5 and torch_model.numClasses == 2
    assert torch_model.getFeaturesCols() == ["user=user_id", "context=context"]

    out = model.transform(test)
    assert isinstance(out.schema["prediction"].dataType, DoubleType)
    assert isinstance(out.schema["probability"].dataType, VectorUDT)
    assert out.columns[: len(test.columns)] == test.columns
    assert MulticlassClassificationEvaluator(metricName="accuracy").evaluate(out) >= 0.9
    before = out.select("id", "prediction", "rawPrediction").orderBy("id").collect()
    assert len(before) == USERS

    # saved and loaded: the layout travels in the metadata, the predictions are identical
    model.write().overwrite().save(str(tmp_path / "pipeline_model"))
    meta_file = next((tmp_path / "pipeline_model" / "stages").glob("1_*/metadata/part-*"))
    meta = json.loads(meta_file.read_text())
    assert meta["inputs"] == layout.to_dict() and meta["numFeatures"] == 5
    assert meta["paramMap"]["featuresCols"] == ["user=user_id", "context=context"]
    monkeypatch.setattr(allowlist, "_REGISTERED", [])
    allowlist.allow_model_modules("tests.unit.user_models")
    loaded = PipelineModel.load(str(tmp_path / "pipeline_model"))
    assert loaded.stages[-1].layout == layout
    after = loaded.transform(test).select("id", "prediction", "rawPrediction").orderBy("id")
    b = after.collect()
    assert [r.prediction for r in before] == [r.prediction for r in b]
    assert all(
        np.array_equal(x.rawPrediction, y.rawPrediction) for x, y in zip(before, b, strict=True)
    )

    # the same inputs under other column names, named in the trained form
    renamed = loaded.stages[0].transform(test).withColumnRenamed("user_id", "uid")
    again = loaded.stages[-1].copy()
    again.setFeaturesCols({"context": "context", "user": "uid"})
    c = again.transform(renamed).select("id", "prediction").orderBy("id").collect()
    assert [r.prediction for r in c] == [r.prediction for r in before]
    with pytest.raises(ConfigError, match="does not name this model's inputs"):
        again.setFeaturesCols(["uid", "context"]).transform(renamed)

    # the unfitted pipeline keeps featuresCols
    pipeline.write().overwrite().save(str(tmp_path / "pipeline"))
    clf = Pipeline.load(str(tmp_path / "pipeline")).getStages()[-1]
    assert clf._features_spec() == ({"user": "user_id", "context": "context"}, "featuresCols")


def test_typed_fit_checks_columns_and_labels_before_training(spark):  # type: ignore[no-untyped-def]
    from pyspark.sql import functions as F

    train, _ = user_frames(spark)
    clf = user_classifier(maxEpochs=1)
    with_context = train.selectExpr("*", "array(c0, c1, c2, c3) AS context")
    with pytest.raises(DataError, match="no column 'nope' \\(featuresCols\\)"):
        clf.copy({clf.featuresCols: ["user=nope", "context=context"]}).fit(with_context)
    with pytest.raises(DataError, match="no label column 'target' \\(labelCol\\)"):
        clf.copy({clf.labelCol: "target"}).fit(with_context)
    shifted = with_context.withColumn("label", F.col("label") + 5)
    with pytest.raises(DataError, match="found labels in \\[5, 6\\]"):
        clf.fit(shifted)
    # ids as floats: the model refuses them, and the Trainer's message says why
    with pytest.raises(DataError, match="does not accept a batch of its inputs"):
        clf.copy({clf.featureDtypes: '{"user": "float32"}'}).fit(with_context)


def test_a_model_saved_before_typed_inputs_loads_as_the_plain_layout(spark, tmp_path):  # type: ignore[no-untyped-def]
    import torch

    from sparktrain.models import digits_mlp
    from sparktrain.result import state_to_bytes

    torch.manual_seed(0)
    model = TorchClassificationModel()._set_state(
        state_to_bytes(digits_mlp().state_dict()), num_features=64, num_outputs=10
    )
    model._set(modelFn=DIGITS_MODEL)
    path = tmp_path / "old_model"
    model.save(str(path))
    part = next((path / "metadata").glob("part-*"))
    meta = json.loads(part.read_text())
    new = ("featuresCols", "featureShapes", "featureDtypes", "decode", "collate")
    for section in ("paramMap", "defaultParamMap"):
        meta[section] = {k: v for k, v in meta[section].items() if k not in new}
    del meta["inputs"]
    part.write_text(json.dumps(meta) + "\n")
    part.with_name(f".{part.name}.crc").unlink(missing_ok=True)  # Hadoop's checksum

    loaded = TorchClassificationModel.load(str(path))
    assert loaded.layout.is_plain and loaded.layout.width == 64 and loaded.numFeatures == 64
    assert loaded.getFeaturesCols() == [] and loaded.getFeatureShapes() == "{}"
    _, test = pixel_frames(spark)
    vectors = assembled(test).orderBy("id").limit(5)
    rows = loaded.transform(vectors).select("id", "rawPrediction").orderBy("id").collect()
    want = model.transform(vectors).select("id", "rawPrediction").orderBy("id").collect()
    assert [r.rawPrediction for r in rows] == [r.rawPrediction for r in want]


LOOP_PARAMS = (
    "lrSchedule",
    "lrScheduleKwargs",
    "lrScheduleInterval",
    "warmupSteps",
    "precision",
    "fp16SkipLimit",
    "accumulateSteps",
    "clipGradNorm",
    "earlyStopping",
    "metrics",
    "tensorboardDir",
    "mlflowTrackingUri",
    "mlflowExperiment",
)


def _strip_params(path, names) -> None:  # type: ignore[no-untyped-def]
    """Rewrite a save's metadata as if ``names`` had not existed when it was written."""
    part = next((path / "metadata").glob("part-*"))
    meta = json.loads(part.read_text())
    for section in ("paramMap", "defaultParamMap"):
        meta[section] = {k: v for k, v in meta[section].items() if k not in names}
    part.write_text(json.dumps(meta) + "\n")
    part.with_name(f".{part.name}.crc").unlink(missing_ok=True)  # Hadoop's checksum


def test_saves_from_before_the_loop_params_load_with_their_defaults(spark, tmp_path):  # type: ignore[no-untyped-def]
    import torch

    from sparktrain.models import digits_mlp
    from sparktrain.result import state_to_bytes

    defaults = TorchClassifier()
    estimator = TorchClassifier(modelFn=DIGITS_MODEL, maxEpochs=3, precision="bf16")
    estimator.save(str(tmp_path / "estimator"))
    _strip_params(tmp_path / "estimator", LOOP_PARAMS)
    loaded = TorchClassifier.load(str(tmp_path / "estimator"))
    assert loaded.uid == estimator.uid and loaded.getMaxEpochs() == 3
    for name in LOOP_PARAMS:
        param = loaded.getParam(name)
        assert not loaded.isSet(param)
        assert loaded.getOrDefault(param) == defaults.getOrDefault(defaults.getParam(name))
    assert loaded._train_config().precision == "fp32"

    torch.manual_seed(0)
    model = TorchClassificationModel()._set_state(
        state_to_bytes(digits_mlp().state_dict()), num_features=64, num_outputs=10
    )
    model._set(modelFn=DIGITS_MODEL)
    model.save(str(tmp_path / "model"))
    _strip_params(tmp_path / "model", LOOP_PARAMS)
    again = TorchClassificationModel.load(str(tmp_path / "model"))
    assert again.getPrecision() == "fp32" and again.getEarlyStopping() == "{}"
    assert again.getMetrics() == [] and again.numClasses == 10
