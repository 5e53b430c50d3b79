"""Your own training loop on scikit-learn's digits: ``sparktrain.run`` with the example
``train_fn`` ``sparktrain.recipes:digits_train_fn`` (an MLP, Adam, ``ctx.batches``,
``ctx.report``, ``ctx.checkpoint``; see docs/run.md).

    spark-submit --master local[2] jobs/run_digits.py
    python jobs/run_digits.py --master local[2] --epochs 5 --precision bf16
    python jobs/run_digits.py --master local[2] --strategy tree \\
        --set lr_schedule=CosineAnnealingLR --set warmup_steps=20 --set accumulate_steps=2
    python jobs/run_digits.py --master local[2] --set checkpoint_dir=/tmp/digits-ckpt \\
        --set 'early_stopping={metric = "accuracy", patience = 3}'

The test split is the validation data: every epoch's report holds its exact accuracy and
log loss over both ranks' rows. At the end the driver loads the returned weights into a
fresh MLP and scores the test split itself. The job prints one line, then a JSON object
with the figures and the summary's main keys.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

TRAIN_FN = "sparktrain.recipes:digits_train_fn"
SUMMARY_KEYS = (
    "strategy",
    "compression",
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
    p.add_argument("--workers", type=int, default=2, help="training tasks (default 2)")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.003, help="Adam's learning rate")
    p.add_argument("--strategy", default="ring", choices=("ring", "tree", "ps"))
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other TrainConfig key, as in `sparktrain train --set` (repeatable)",
    )
    p.add_argument("--master", help="Spark master URL (default: spark-submit's)")
    p.add_argument("--summary-json", metavar="PATH", help="write the run's summary here")
    args = p.parse_args(argv)
    if args.workers < 1 or args.epochs < 1:
        p.error("--workers and --epochs must be >= 1")
    return args


def make_config(args: argparse.Namespace) -> Any:
    from sparktrain import TrainConfig
    from sparktrain.config import apply_overrides

    values = {
        "strategy": args.strategy,
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "num_workers": args.workers,
        "precision": args.precision,
        "progress": False,
    }
    return TrainConfig.from_dict(apply_overrides(values, args.set))


def driver_accuracy(state: dict[str, Any], x: Any, y: Any) -> float:
    """The returned weights in a fresh MLP, scored on the driver."""
    import torch

    from sparktrain.models import mlp

    model = mlp(64, (128,), 10)
    model.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        predicted = model(torch.from_numpy(x)).argmax(dim=1).numpy()
    return float((predicted == y).mean())


def main(argv: list[str]) -> int:
    args = parse(argv)
    import sparktrain
    from sparktrain import datasets
    from sparktrain.session import get_or_create_session

    config = make_config(args)
    spark = get_or_create_session(args.master, app_name="sparktrain-run-digits")
    split = datasets.digits()
    train = datasets.to_dataframe(spark, split.x_train, split.y_train, config.num_workers)
    test = datasets.to_dataframe(spark, split.x_test, split.y_test, config.num_workers)
    result = sparktrain.run(TRAIN_FN, train, validation_data=test, config=config, spark=spark)
    last = result.history[-1]
    accuracy = driver_accuracy(result.value["model"], split.x_test, split.y_test)
    s = result.summary
    print(
        f"run digits: test accuracy {accuracy:.4f} (last report {last['accuracy']:.4f}, "
        f"log loss {last['log_loss']:.4f}) | {len(result.history)} of {config.epochs} epochs | "
        f"wall {s['wall_s']:.1f} s | {s['strategy']}, {s['world_size']} workers, "
        f"{s.get('precision', config.precision)}"
    )
    figures = {
        "test_accuracy": accuracy,
        "epochs_run": len(result.history),
        "last_report": last,
        **{k: s[k] for k in SUMMARY_KEYS if k in s},
    }
    print(json.dumps(figures))
    if args.summary_json:
        with open(args.summary_json, "w") as fh:
            json.dump(s, fh, indent=2, default=str)
        print(f"summary written to {args.summary_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
