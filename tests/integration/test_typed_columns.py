"""Typed, several-column inputs through a real Spark (local[2]): ids above 2**24 stay
exact int64, variable-length token columns train through padding and masks, an image
column takes its shape from ``feature_shapes``, binary columns go through ``decode``;
spilled and in-memory partitions train to the same weights; pipelines and tree_aggregate
refuse what they cannot take."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparktrain import Trainer, datasets
from sparktrain.errors import ConfigError, DataError
from tests.integration.fixtures import accuracy, digits, fast_config

# ids far above 2**24: float32 holds only every 4th integer there, so a float round trip
# merges neighbouring ids, and with them the labels this task gives them
ID_BASE = 1 << 25
IDS = 400


def _ids_frame(spark, rows_per_id: int = 3, seed: int = 0):  # type: ignore[no-untyped-def]
    import pyarrow as pa

    rng = np.random.default_rng(seed)
    j = np.repeat(np.arange(IDS), rows_per_id)
    ids = (ID_BASE + j).astype(np.int64)
    label = (j % 2).astype(np.float64)  # neighbours differ: only exact ids can tell them
    dense = rng.normal(size=(len(j), 4)).astype(np.float32)
    table = pa.table(
        {
            "user_id": pa.array(ids, pa.int64()),
            "context": pa.FixedSizeListArray.from_arrays(pa.array(dense.reshape(-1)), 4).cast(
                pa.list_(pa.float32())
            ),
            "clicked": pa.array(label),
        }
    )
    return spark.createDataFrame(table).repartition(2)


def _ids_config(**overrides):  # type: ignore[no-untyped-def]
    base = {"epochs": 12, "batch_size": 32, "lr": 0.05, "optimizer": "adam", "optimizer_kwargs": {}}
    return fast_config(**{**base, **overrides})


IDS_MODEL = "sparktrain.models:ids_and_dense"
IDS_KWARGS = {"num_embeddings": 1000, "dim": 8, "dense_features": 4, "hidden": 16}


def test_int64_ids_above_2_to_24_train_without_a_float_round_trip(spark):  # type: ignore[no-untyped-def]
    df = _ids_frame(spark)
    result = Trainer(IDS_MODEL, _ids_config(), model_kwargs=IDS_KWARGS).fit(
        df, features_col={"ids": "user_id", "dense": "context"}, label_col="clicked"
    )
    # every id's label is learnable only from the exact id (neighbours alternate)
    assert result.summary["metric_name"] == "train_accuracy"
    assert result.summary["metric_value"] > 0.97
    inputs = result.summary["inputs"]
    assert inputs["call"] == "keyword"
    assert [(c["key"], c["dtype"]) for c in inputs["columns"]] == [
        ("ids", "int64"),
        ("dense", "float32"),
    ]
    # the same ids through float32 collapse 4 to 1: the model cannot beat ~1/2 on them
    as_float = torch.tensor((ID_BASE + np.arange(IDS)).astype(np.float32).astype(np.int64))
    assert len(torch.unique(as_float)) <= IDS // 2


def test_a_spilled_typed_partition_trains_to_the_same_weights_as_in_memory(spark):  # type: ignore[no-untyped-def]
    df = _ids_frame(spark).cache()
    states = {}
    paths = {}
    for budget in (512.0, 0.0):
        cfg = _ids_config(epochs=2, data_memory_mb=budget, seed=3)
        result = Trainer(IDS_MODEL, cfg, model_kwargs=IDS_KWARGS).fit(
            df, features_col=["user_id", "context"], label_col="clicked"
        )
        states[budget] = result.model.state_dict()
        paths[budget] = result.summary["data_path"]
    df.unpersist()
    assert paths == {512.0: "memory", 0.0: "spilled"}
    for name, tensor in states[512.0].items():
        assert torch.equal(tensor, states[0.0][name]), name


def _tokens_frame(spark, rows: int = 1200, seed: int = 0):  # type: ignore[no-untyped-def]
    import pyarrow as pa

    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 25, rows)
    seqs = [rng.integers(1, 60, n) for n in lengths]
    label = np.array([float(7 in s) for s in seqs])
    for s, y in zip(seqs, label, strict=True):  # balance the classes a little
        if not y and rng.random() < 0.4:
            s[rng.integers(len(s))] = 7
    label = np.array([float(7 in s) for s in seqs])
    table = pa.table(
        {"tokens": pa.array([s.tolist() for s in seqs], pa.list_(pa.int32())), "y": label}
    )
    return spark.createDataFrame(table).repartition(2)


@pytest.mark.parametrize("model", ["token_bag", "token_gru"])
def test_a_variable_length_token_column_trains_through_padding_and_masks(spark, model):  # type: ignore[no-untyped-def]
    df = _tokens_frame(spark)
    cfg = _ids_config(epochs=8, lr=0.02, feature_shapes={"tokens": [-1]}, strategy="tree")
    result = Trainer(f"sparktrain.models:{model}", cfg, model_kwargs={"vocab": 60}).fit(
        df, features_col="tokens", label_col="y"
    )
    assert result.summary["inputs"]["columns"][0]["kind"] == "ragged"
    assert result.summary["metric_value"] > 0.9, result.history


def _digits_split_frames(spark, binary: bool = False):  # type: ignore[no-untyped-def]
    import pyarrow as pa

    split = digits()

    def frame(x, y):  # type: ignore[no-untyped-def]
        if binary:
            image = pa.array(datasets.digit_bytes(x), pa.binary())
        else:
            image = pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), 64).cast(
                pa.list_(pa.float32())
            )
        return spark.createDataFrame(pa.table({"image": image, "label": y.astype(float)}))

    return frame(split.x_train, split.y_train).repartition(2), frame(split.x_test, split.y_test)


@pytest.mark.parametrize("strategy", ["ring", "ps"])
def test_an_image_column_with_a_declared_shape_trains_a_cnn_without_unflatten(spark, strategy):  # type: ignore[no-untyped-def]
    train, test = _digits_split_frames(spark)
    cfg = fast_config(epochs=6, feature_shapes={"image": [1, 8, 8]}, strategy=strategy)
    result = Trainer("sparktrain.models:digits_cnn_shaped", cfg).fit(
        train, features_col="image", validation_data=test
    )
    split = digits()
    x_test = split.x_test.reshape(-1, 1, 8, 8)
    assert accuracy(result.model, x_test, split.y_test) > 0.9
    assert result.summary["metric_value"] > 0.9


def test_a_binary_column_goes_through_decode_in_the_loader(spark):  # type: ignore[no-untyped-def]
    train, test = _digits_split_frames(spark, binary=True)
    cfg = fast_config(epochs=6, decode={"image": "sparktrain.datasets:decode_digit"})
    result = Trainer("sparktrain.models:digits_cnn_shaped", cfg).fit(
        train, features_col="image", validation_data=test
    )
    assert result.summary["inputs"]["columns"][0]["kind"] == "binary"
    assert result.summary["metric_value"] > 0.9


def test_several_label_columns_train_a_multi_output_regressor(spark):  # type: ignore[no-untyped-def]
    from pyspark.sql import functions as F

    train, _ = _digits_split_frames(spark)
    # two targets a row: the image's mean and its first pixel row's mean
    df = train.select(
        "image",
        F.aggregate("image", F.lit(0.0), lambda a, v: a + v).alias("total"),
        F.slice("image", 1, 8).alias("top"),
    ).select(
        "image",
        (F.col("total") / 64).alias("mean"),
        (F.aggregate("top", F.lit(0.0), lambda a, v: a + v) / 8).alias("top_mean"),
    )
    cfg = fast_config(epochs=10, loss="mse", lr=0.05)
    model_kwargs = {"in_features": 64, "hidden": [32], "out_features": 2}
    result = Trainer("sparktrain.models:mlp", cfg, model_kwargs=model_kwargs).fit(
        df, features_col="image", label_col=["mean", "top_mean"]
    )
    assert result.summary["inputs"]["label_width"] == 2
    assert result.summary["metric_value"] < 0.05  # RMSE over both outputs


def test_typed_inputs_fail_on_the_driver_with_the_column_and_the_fix(spark):  # type: ignore[no-untyped-def]
    df = _tokens_frame(spark, rows=50)
    # a model asking for the mask of a column not declared variable-length
    with pytest.raises(
        DataError, match=r"tokens_mask: declare .*feature_shapes=\{'tokens': \[-1\]\}"
    ):
        Trainer("sparktrain.models:token_bag", fast_config(epochs=1)).fit(
            df, features_col="tokens", label_col="y"
        )
    # rows of different lengths without [-1]: named at the ingest, before any socket
    cfg = fast_config(epochs=1, loss="mse")
    with pytest.raises(DataError, match=r"column 'tokens', partition \d.*\[-1\]"):
        Trainer("sparktrain.models:embedding_regressor", cfg).fit(
            df, features_col="tokens", label_col="y"
        )
    # a model argument where a variable-length column's mask goes
    from pyspark.sql import functions as F

    taken = df.withColumn("flag", F.lit(1))
    cfg = fast_config(feature_shapes={"tokens": [-1]})
    with pytest.raises(DataError, match="'tokens_mask' is taken by column 'flag'"):
        Trainer("sparktrain.models:token_bag", cfg).fit(
            taken, features_col={"tokens": "tokens", "tokens_mask": "flag"}, label_col="y"
        )
    # bytes without a decode
    train, _ = _digits_split_frames(spark, binary=True)
    with pytest.raises(DataError, match="column 'image' holds bytes: give decode"):
        Trainer("sparktrain.models:digits_cnn_shaped", fast_config()).fit(
            train, features_col="image"
        )
    # a shape that does not match the rows
    train, _ = _digits_split_frames(spark)
    with pytest.raises(DataError, match=r"feature_shapes\['image'\] = \[1, 7, 7\] needs 49"):
        Trainer(
            "sparktrain.models:digits_cnn_shaped", fast_config(feature_shapes={"image": [1, 7, 7]})
        ).fit(train, features_col="image")
    # an option naming no input
    with pytest.raises(ConfigError, match="feature_shapes names 'pixels'"):
        Trainer(
            "sparktrain.models:digits_cnn_shaped", fast_config(feature_shapes={"pixels": [1, 8, 8]})
        ).fit(train, features_col="image")


@pytest.mark.parametrize(
    "overrides",
    [{"strategy": "tree_aggregate"}, {"parallelism_pipeline": 2}],
    ids=["tree_aggregate", "pipeline"],
)
def test_strategies_that_take_one_float_vector_refuse_typed_inputs_by_name(spark, overrides):  # type: ignore[no-untyped-def]
    df = _ids_frame(spark, rows_per_id=1)
    cfg = fast_config(**overrides)
    with pytest.raises(ConfigError, match="one float32 features vector.*ring', 'tree' or 'ps'"):
        Trainer(IDS_MODEL, cfg, model_kwargs=IDS_KWARGS).fit(
            df, features_col={"ids": "user_id", "dense": "context"}, label_col="clicked"
        )
