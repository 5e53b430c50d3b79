"""Your own training loop over a token column: ``sparktrain.run`` with
``sparktrain.recipes:transformer_train_fn`` (a transformer encoder) on the synthetic order
task (``sparktrain.datasets.order_task``), where the label is whether marker A comes
before marker B: only token order tells, so a bag of tokens cannot beat 0.5.

    spark-submit --master local[2] jobs/run_transformer.py
    python jobs/run_transformer.py --master local[2] --epochs 4 --baseline
    python jobs/run_transformer.py --master local[2] --precision bf16 --set clip_grad_norm=1.0

The ``tokens`` column is ``array<bigint>`` of lengths 8 to 24, declared
``feature_shapes = {tokens = [-1]}``: batches carry it padded, with ``tokens_mask``
(docs/columns.md). ``--baseline`` also trains ``sparktrain.models:token_bag`` on the same
data with ``Trainer.fit``. The job prints one line, then a JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

TRAIN_FN = "sparktrain.recipes:transformer_train_fn"
SUMMARY_KEYS = (
    "strategy",
    "world_size",
    "steps_per_epoch",
    "precision",
    "wall_s",
    "stage_s",
    "bytes_sent",
    "restarts",
    "early_stopping",
)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--train-rows", type=int, default=2400)
    p.add_argument("--val-rows", type=int, default=600)
    p.add_argument("--workers", type=int, default=2, help="training tasks (default 2)")
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.003, help="AdamW's learning rate")
    p.add_argument("--strategy", default="ring", choices=("ring", "tree", "ps"))
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other TrainConfig key, as in `sparktrain train --set` (repeatable)",
    )
    p.add_argument(
        "--baseline",
        action="store_true",
        help="also fit sparktrain.models:token_bag (Trainer.fit, adam, lr 0.01, 8 epochs)",
    )
    p.add_argument("--master", help="Spark master URL (default: spark-submit's)")
    p.add_argument("--summary-json", metavar="PATH", help="write the run's summary here")
    args = p.parse_args(argv)
    if min(args.train_rows, args.val_rows, args.workers, args.epochs) < 1:
        p.error("--train-rows, --val-rows, --workers and --epochs must be >= 1")
    return args


def order_frame(spark: Any, n: int, seed: int, partitions: int) -> Any:
    """``tokens`` (array<bigint>) and ``label`` (0/1) rows of the order task."""
    import pyarrow as pa

    from sparktrain import datasets

    sequences, labels = datasets.order_task(n, seed=seed)
    table = pa.table({"tokens": pa.array(sequences, pa.list_(pa.int64())), "label": labels})
    return spark.createDataFrame(table).repartition(partitions)


def main(argv: list[str]) -> int:
    args = parse(argv)
    import sparktrain
    from sparktrain import TrainConfig, Trainer
    from sparktrain.config import apply_overrides
    from sparktrain.session import get_or_create_session

    values = {
        "strategy": args.strategy,
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "num_workers": args.workers,
        "precision": args.precision,
        "feature_shapes": {"tokens": [-1]},
        "progress": False,
    }
    config = TrainConfig.from_dict(apply_overrides(values, args.set))
    spark = get_or_create_session(args.master, app_name="sparktrain-run-transformer")
    train = order_frame(spark, args.train_rows, 1, config.num_workers)
    val = order_frame(spark, args.val_rows, 2, config.num_workers)
    result = sparktrain.run(
        TRAIN_FN,
        train,
        columns={"tokens": "tokens"},
        validation_data=val,
        config=config,
        spark=spark,
    )
    last = result.history[-1]
    s = result.summary
    figures: dict[str, Any] = {
        "val_accuracy": last["accuracy"],
        "val_auc": last["auc"],
        "epochs_run": len(result.history),
        "last_report": last,
        **{k: s[k] for k in SUMMARY_KEYS if k in s},
    }
    line = (
        f"run transformer: val accuracy {last['accuracy']:.4f} (AUC {last['auc']:.4f}) | "
        f"{len(result.history)} of {config.epochs} epochs | wall {s['wall_s']:.1f} s | "
        f"{s['strategy']}, {s['world_size']} workers, {s.get('precision', config.precision)}"
    )
    if args.baseline:
        bag = Trainer(
            "sparktrain.models:token_bag",
            TrainConfig(
                strategy=config.strategy,
                num_workers=config.num_workers,
                epochs=8,
                batch_size=config.batch_size,
                lr=0.01,
                optimizer="adam",
                feature_shapes={"tokens": [-1]},
                progress=False,
            ),
            model_kwargs={"vocab": 16},
            spark=spark,
        ).fit(train, features_col={"tokens": "tokens"}, validation_data=val)
        figures["baseline_token_bag_val_accuracy"] = bag.summary["metric_value"]
        line += f" | token_bag baseline: val accuracy {bag.summary['metric_value']:.4f}"
    print(line)
    print(json.dumps(figures))
    if args.summary_json:
        with open(args.summary_json, "w") as fh:
            json.dump(s, fh, indent=2, default=str)
        print(f"summary written to {args.summary_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
