"""Train from Parquet: write a dataset of a realistic shape with Spark, read it back with
``spark.read.parquet`` and train an MLP on it with ``sparktrain.Trainer``.

    spark-submit --master local[2] jobs/parquet_train.py                     # 2M rows
    python jobs/parquet_train.py --master local[2] --rows 200000 --data-memory-mb 16
    python jobs/parquet_train.py --master local[2] --path /data/rows --reuse  # train only
    python jobs/parquet_train.py --master local[2] --with-ids   # ids as an int64 input too

The dataset: ``id`` (int64), ``features`` (array<float>, 64 values), ``label`` (int, 0..9);
the features are N(0, 1) with 2 added to the ones whose index is the label modulo 10, so
the MLP has something to learn. 2M rows are 512 MiB of float32 features: with the default
``data_memory_mb`` (512) each of 2 workers holds its 256 MiB in RAM; a smaller
``--data-memory-mb`` makes them spill to a memory-mapped file under ``spark.local.dir``
(see docs/data.md). ``--with-ids`` feeds the ``id`` column to the model as well, as an
int64 input next to the features (``features_col={"ids": "id", "dense": "features"}``,
model ``sparktrain.models:ids_and_dense``; see docs/columns.md). The job prints the
accuracy, the samples/s and the summary's data keys.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

WIDTH = 64
CLASSES = 10
DATA_KEYS = ("data_path", "data_spilled_bytes", "data_wait_s", "peak_anon_bytes_per_worker")


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=2_000_000, help="rows to write (default 2M)")
    p.add_argument(
        "--path",
        default=os.path.join(tempfile.gettempdir(), "sparktrain-parquet-example"),
        help="where the Parquet dataset goes (overwritten unless --reuse)",
    )
    p.add_argument("--reuse", action="store_true", help="train on the dataset at --path as is")
    p.add_argument("--data-memory-mb", type=float, default=None, help="TrainConfig default: 512")
    p.add_argument("--prefetch-batches", type=int, default=None, help="TrainConfig default: 2")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--files", type=int, default=8, help="Parquet files to write")
    p.add_argument(
        "--with-ids",
        action="store_true",
        help="also feed the int64 id column to the model (an embedding next to the MLP)",
    )
    p.add_argument("--master", help="Spark master URL (default: spark-submit's)")
    p.add_argument("--summary-json", metavar="PATH", help="write the run's summary here")
    args = p.parse_args(argv)
    if args.rows < 1 or args.workers < 1 or args.files < 1:
        p.error("--rows, --workers and --files must be >= 1")
    return args


def write_dataset(spark: Any, rows: int, path: str, files: int) -> None:
    from pyspark.sql import functions as F

    label = (F.col("id") % CLASSES).cast("int")
    features = F.array(
        *[
            (F.randn(seed=i) + F.when(label == i % CLASSES, 2.0).otherwise(0.0)).cast("float")
            for i in range(WIDTH)
        ]
    )
    df = spark.range(0, rows, numPartitions=files).select(
        F.col("id"), features.alias("features"), label.alias("label")
    )
    df.write.mode("overwrite").parquet(path)


def main(argv: list[str]) -> int:
    args = parse(argv)
    from sparktrain import TrainConfig, Trainer
    from sparktrain.session import get_or_create_session

    spark = get_or_create_session(args.master, app_name="sparktrain-parquet-train")
    if not args.reuse:
        started = time.perf_counter()
        write_dataset(spark, args.rows, args.path, args.files)
        print(
            f"wrote {args.rows:,} rows to {args.path} in {time.perf_counter() - started:.1f} s",
            flush=True,
        )
    df = spark.read.parquet(args.path)
    options = {
        k: v
        for k, v in (
            ("data_memory_mb", args.data_memory_mb),
            ("prefetch_batches", args.prefetch_batches),
        )
        if v is not None
    }
    config = TrainConfig(
        strategy="ring",
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        num_workers=args.workers,
        validation_fraction=0.05,
        progress=False,
        **options,
    )
    model_fn = "sparktrain.models:mlp"
    model_kwargs: dict[str, Any] = {"in_features": WIDTH, "hidden": [128], "out_features": CLASSES}
    features_col: Any = "features"
    if args.with_ids:
        model_fn = "sparktrain.models:ids_and_dense"
        model_kwargs = {
            "num_embeddings": 1000,
            "dim": 16,
            "dense_features": WIDTH,
            "hidden": 128,
            "out_features": CLASSES,
        }
        features_col = {"ids": "id", "dense": "features"}
    result = Trainer(model_fn, config, model_kwargs=model_kwargs, spark=spark).fit(
        df, features_col=features_col, label_col="label"
    )
    s = result.summary
    print(
        f"parquet: {s['train_samples']:,} training rows | validation {s['metric_name']} "
        f"{s['metric_value']:.4f} | {s['samples_per_s']:,.0f} samples/s | wall "
        f"{s['wall_s']:.1f} s (training {s['train_s']:.1f} s) | data_memory_mb "
        f"{config.data_memory_mb:g}{' | inputs: ids (int64) + features' if args.with_ids else ''}"
    )
    print(json.dumps({k: s.get(k) for k in DATA_KEYS}))
    if args.summary_json:
        result.save_summary(args.summary_json)
        print(f"summary written to {args.summary_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
