"""Data for integration tests: scikit-learn's digits as DataFrames and RDDs."""

from __future__ import annotations

import functools

import numpy as np

from sparktrain import TrainConfig, datasets

DIGITS_MODEL = "sparktrain.models:digits_mlp"

# Every training path's summary has these keys (docs/summary.md).
SUMMARY_KEYS = frozenset(
    {
        "strategy",
        "compression",
        "world_size",
        "epochs",
        "train_samples",
        "train_rows_per_worker",
        "steps_per_epoch",
        "num_parameters",
        "final_loss",
        "metric_name",
        "metric_value",
        "wall_s",
        "stage_s",
        "train_s",
        "comm_s",
        "samples_per_s",
        "bytes_sent",
        "wire_bytes",
        "compression_ratio",
        "restarts",
        "replicas_in_sync",
        "history",
        "config",
    }
)


@functools.cache
def digits() -> datasets.Split:
    return datasets.digits()


def digits_frames(spark, partitions: int = 2, vector: bool = False):  # type: ignore[no-untyped-def]
    split = digits()
    train = datasets.to_dataframe(spark, split.x_train, split.y_train, partitions)
    test = datasets.to_dataframe(spark, split.x_test, split.y_test, partitions)
    if vector:
        from pyspark.ml.functions import array_to_vector

        train = train.select(array_to_vector("features").alias("pixels"), "label")
        test = test.select(array_to_vector("features").alias("pixels"), "label")
    return train, test


def digits_rdd(spark, partitions: int = 2):  # type: ignore[no-untyped-def]
    split = digits()
    rows = [(x, float(y)) for x, y in zip(split.x_train, split.y_train, strict=True)]
    return spark.sparkContext.parallelize(rows, partitions)


def fast_config(**overrides) -> TrainConfig:  # type: ignore[no-untyped-def]
    base = {
        "epochs": 20,
        "batch_size": 32,
        "lr": 0.05,
        "optimizer_kwargs": {"momentum": 0.9},
        "num_workers": 2,
        "progress": False,
        "comm_timeout": 30.0,
    }
    return TrainConfig(**{**base, **overrides})


def accuracy(model, x: np.ndarray, y: np.ndarray) -> float:  # type: ignore[no-untyped-def]
    import torch

    with torch.no_grad():
        return float((model(torch.from_numpy(x)).argmax(1).numpy() == y).mean())
