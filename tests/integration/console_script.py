"""The scenarios of test_console.py, run in a subprocess whose console the test reads:
the public API on local[2] (not a test module: pytest collects test_*.py only).

    python -m tests.integration.console_script DEBUG_LOG_PATH
"""

from __future__ import annotations

import logging
import sys
import tempfile

from pyspark.sql import functions as F

from sparktrain import TrainConfig, Trainer, datasets
from sparktrain.errors import DataError
from sparktrain.task.faults import FaultPlan

MODEL = "sparktrain.models:digits_mlp"


def config(**overrides: object) -> TrainConfig:
    values = {
        "epochs": 2,
        "batch_size": 32,
        "lr": 0.05,
        "optimizer": "sgd",
        "num_workers": 2,
        "progress": False,
    }
    return TrainConfig(**{**values, **overrides})  # type: ignore[arg-type]


def fit_fails_on_the_driver_then_stop() -> None:
    """sparktrain's session (its warm-up job still starting), a fit that fails at once,
    then stop: no warm-up task may be left to break."""
    from sparktrain.session import get_or_create_session

    spark = get_or_create_session("local[2]")
    split = datasets.digits()
    train = datasets.to_dataframe(spark, split.x_train, split.y_train, 2)
    try:
        Trainer(MODEL, config(), spark=spark).fit(train, features_col="nope")
    except DataError as exc:
        print(f"caught: DataError: {exc}", flush=True)
    spark.stop()


def plain_session_faults() -> None:
    """The user's own SparkSession (Spark's default logging, its progress bar), rows made
    in Python: a killed worker the stage runner recovers from, then labels out of range."""
    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master("local[2]")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.ui.enabled", "false")
        .getOrCreate()
    )
    split = datasets.digits()
    rows = [(x.tolist(), float(y)) for x, y in zip(split.x_train, split.y_train, strict=True)]
    train = spark.createDataFrame(rows, ["features", "label"])
    marker = f"{tempfile.mkdtemp(prefix='sparktrain-console-')}/fault"
    plan = FaultPlan(rank=1, step=10, marker=marker, kind="exit")
    result = Trainer(MODEL, config(), spark=spark, fault_plan=plan).fit(train)
    print(f"recovered: restarts={result.summary['restarts']}", flush=True)
    try:
        Trainer(MODEL, config(), spark=spark).fit(train.withColumn("label", F.col("label") + 20))
    except DataError as exc:
        print(f"caught: DataError: {exc}", flush=True)
    spark.stop()


def main(debug_log: str) -> None:
    debug = logging.FileHandler(debug_log)
    debug.setLevel(logging.DEBUG)
    logging.getLogger("sparktrain").addHandler(debug)
    logging.getLogger("sparktrain").setLevel(logging.DEBUG)
    console = logging.StreamHandler()  # what a user who asked for INFO sees
    console.setLevel(logging.INFO)
    logging.getLogger("sparktrain").addHandler(console)
    plain_session_faults()  # first: its JVM starts with Spark's default logging
    fit_fails_on_the_driver_then_stop()
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
