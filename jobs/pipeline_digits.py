"""spark-submit entry point: sparktrain as an MLlib Pipeline stage on scikit-learn's digits.

VectorAssembler (64 pixel columns) -> StandardScaler -> TorchClassifier, fitted on the
training split, scored on the test split with MulticlassClassificationEvaluator; the
fitted PipelineModel is saved and reloaded to show that it predicts the same.

spark-submit --master local[2] jobs/pipeline_digits.py
spark-submit --master local[2] jobs/pipeline_digits.py --strategy tree --epochs 15 \
    --save /tmp/digits-pipeline
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import numpy as np


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="ring", help="ring | tree | ps | tree_aggregate")
    parser.add_argument("--workers", type=int, default=2, help="training tasks (numWorkers)")
    parser.add_argument("--epochs", type=int, default=10, help="maxEpochs")
    parser.add_argument("--lr", type=float, default=0.003, help="learningRate (adam)")
    parser.add_argument("--save", default="", help="save the PipelineModel here (default: tmp)")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    import pandas as pd
    from pyspark.ml import Pipeline, PipelineModel
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator
    from pyspark.ml.feature import StandardScaler, VectorAssembler

    from sparktrain import datasets
    from sparktrain.ml import TorchClassifier
    from sparktrain.session import get_or_create_session

    args = parse_args(argv)
    spark = get_or_create_session(app_name="sparktrain-pipeline-digits")
    split = datasets.digits()
    pixels = [f"pixel{i}" for i in range(split.x_train.shape[1])]

    def frame(x: np.ndarray, y: np.ndarray):  # type: ignore[no-untyped-def]
        pdf = pd.DataFrame(x.astype(np.float64), columns=pixels)
        pdf["label"] = y.astype(np.float64)
        return spark.createDataFrame(pdf).repartition(args.workers)

    train, test = frame(split.x_train, split.y_train), frame(split.x_test, split.y_test)
    pipeline = Pipeline(
        stages=[
            VectorAssembler(inputCols=pixels, outputCol="raw"),
            StandardScaler(inputCol="raw", outputCol="features"),
            TorchClassifier(
                modelFn="sparktrain.models:digits_mlp",
                optimizer="adam",
                learningRate=args.lr,
                maxEpochs=args.epochs,
                numWorkers=args.workers,
                strategy=args.strategy,
            ),
        ]
    )
    started = time.perf_counter()
    model = pipeline.fit(train)
    fit_s = time.perf_counter() - started
    evaluator = MulticlassClassificationEvaluator(metricName="accuracy")
    accuracy = evaluator.evaluate(model.transform(test))

    with tempfile.TemporaryDirectory(prefix="sparktrain-pipeline-") as scratch:
        # without --save the round trip goes through a folder removed afterwards
        path = args.save or scratch
        model.write().overwrite().save(path)
        reloaded = evaluator.evaluate(PipelineModel.load(path).transform(test))
    where = f"saved to {path}" if args.save else "save/load round trip checked"
    print(
        f"pipeline digits: test accuracy {accuracy:.4f} (reloaded {reloaded:.4f}) | "
        f"fit {fit_s:.1f} s | {args.strategy}, {args.workers} workers, {args.epochs} epochs | "
        f"{where}"
    )
    spark.stop()
    return 0 if accuracy == reloaded else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
