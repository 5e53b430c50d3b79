"""The ``sparktrain`` command line (also behind ``spark-submit jobs/*.py``).

    sparktrain train CONFIG.toml [--set key=value ...] [--master URL] [--summary-json PATH]
    sparktrain bench allreduce --world 2 4 --sizes 4K 1M 16M 64M --algos ring tree gloo --json PATH
    sparktrain bench ps --world 2 --epochs 10 --json PATH
    sparktrain bench compression --json PATH
    sparktrain bench mllib --json PATH
    sparktrain bench train --workloads digits synthetic --links none 5g --out docs/results
    sparktrain bench report [--check]
    sparktrain bench pipeline --stages 2 4 --micro-batches 8 --json PATH
    sparktrain bench scaling --worlds 1 2 4 --links none 5g --out docs/results
    sparktrain bench overlap --strategies ring ps --out docs/results

A training config is a TrainConfig (top-level keys) plus a ``[job]`` table that says what
to train on: ``model`` ("package.module:function"), ``model_kwargs``, ``dataset`` and
``dataset_kwargs``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from sparktrain.config import TrainConfig, apply_overrides, load_toml
from sparktrain.errors import SparkTrainError

JOB_DEFAULTS: dict[str, Any] = {
    "job.model": "sparktrain.models:digits_mlp",
    "job.model_kwargs": {},
    "job.dataset": "digits",
    "job.dataset_kwargs": {},
    "job.app_name": "sparktrain",
}


def split_job_keys(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Separate ``job.*`` keys (what to train on) from TrainConfig keys (how)."""
    job = dict(JOB_DEFAULTS)
    rest: dict[str, Any] = {}
    for key, value in values.items():
        if key.startswith("job."):
            if key not in JOB_DEFAULTS:
                raise SparkTrainError(
                    f"unknown config key {key!r}; the [job] table takes "
                    f"{', '.join(k.removeprefix('job.') for k in JOB_DEFAULTS)}"
                )
            job[key] = value
        else:
            rest[key] = value
    return {k.removeprefix("job."): v for k, v in job.items()}, rest


def cmd_train(args: argparse.Namespace) -> int:
    from sparktrain import datasets
    from sparktrain.session import get_or_create_session
    from sparktrain.trainer import Trainer

    values = apply_overrides(load_toml(args.config), args.set or [])
    job, rest = split_job_keys(values)
    config = TrainConfig.from_dict(rest)
    split = datasets.load(job["dataset"], **job["dataset_kwargs"])
    spark = get_or_create_session(args.master, app_name=job["app_name"])
    train_df = datasets.to_dataframe(spark, split.x_train, split.y_train, config.num_workers)
    test_df = datasets.to_dataframe(spark, split.x_test, split.y_test, config.num_workers)
    result = Trainer(job["model"], config, model_kwargs=job["model_kwargs"], spark=spark).fit(
        train_df, validation_data=test_df
    )
    s = result.summary
    name = s["metric_name"].replace("_", " ")
    print(
        f"{job['dataset']}: test {name} {s['metric_value']:.4f} | wall {s['wall_s']:.1f} s "
        f"(training {s['train_s']:.1f} s) | bytes sent {s['bytes_sent'] / 1e6:.2f} MB "
        f"(on the wire {s['wire_bytes'] / 1e6:.2f} MB) | {s['strategy']}, "
        f"{s['world_size']} workers, {s['epochs']} epochs"
    )
    if args.summary_json:
        result.save_summary(args.summary_json)
        print(f"summary written to {args.summary_json}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from sparktrain.bench.allreduce import main as bench_allreduce
    from sparktrain.bench.ps import main as bench_ps

    if args.what == "allreduce":
        return bench_allreduce(args)
    if args.what == "ps":
        return bench_ps(args)
    if args.what == "compression":
        from sparktrain.bench.compression import main as bench_compression

        return bench_compression(args)
    if args.what == "pipeline":
        from sparktrain.bench.pipeline import main as bench_pipeline

        return bench_pipeline(args)
    if args.what == "mllib":
        from sparktrain.bench.mllib import main as bench_mllib

        return bench_mllib(args)
    if args.what == "train":
        from sparktrain.bench.train import main as bench_train

        return bench_train(args)
    if args.what == "report":
        from sparktrain.bench.report import main as bench_report

        return bench_report(args)
    if args.what == "scaling":
        from sparktrain.bench.scaling import main as bench_scaling

        return bench_scaling(args)
    if args.what == "overlap":
        from sparktrain.bench.overlap import main as bench_overlap

        return bench_overlap(args)
    raise SparkTrainError(
        f"unknown benchmark {args.what!r}; available: allreduce, ps, compression, mllib, "
        "train, report, pipeline, scaling, overlap"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparktrain", description=__doc__.split("\n\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a model described by a TOML config")
    train.add_argument("config", help="TOML file, e.g. conf/digits_mlp.toml")
    train.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="override a config key (repeatable; dotted for tables)",
    )
    train.add_argument("--master", help="Spark master URL (default: spark-submit's or local[2])")
    train.add_argument("--summary-json", metavar="PATH", help="write the run's summary here")
    train.set_defaults(func=cmd_train)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="what", required=True)
    from sparktrain.bench.allreduce import add_arguments

    add_arguments(bench_sub.add_parser("allreduce", help="ring/tree allreduce vs torch Gloo"))
    from sparktrain.bench.ps import add_arguments as add_ps_arguments

    add_ps_arguments(
        bench_sub.add_parser("ps", help="parameter server: async/ssp, staleness_lr on/off")
    )
    from sparktrain.bench.compression import add_arguments as add_compression_arguments

    add_compression_arguments(
        bench_sub.add_parser(
            "compression", help="compressor speed (GB/s), ratio; --quality: accuracy vs bytes"
        )
    )
    from sparktrain.bench.mllib import add_arguments as add_mllib_arguments

    add_mllib_arguments(
        bench_sub.add_parser("mllib", help="tree_aggregate vs MLlib's MLP (L-BFGS) on digits")
    )
    from sparktrain.bench.train import add_arguments as add_train_arguments

    add_train_arguments(
        bench_sub.add_parser(
            "train", help="every strategy x compressor vs TorchDistributor and MLlib, same run"
        )
    )
    from sparktrain.bench.report import add_arguments as add_report_arguments

    add_report_arguments(
        bench_sub.add_parser("report", help="regenerate README's results section from the JSON")
    )
    from sparktrain.bench.pipeline import add_arguments as add_pipeline_arguments

    add_pipeline_arguments(
        bench_sub.add_parser("pipeline", help="GPipe vs 1F1B: step time, activation memory")
    )
    from sparktrain.bench.scaling import add_arguments as add_scaling_arguments

    add_scaling_arguments(
        bench_sub.add_parser(
            "scaling", help="worlds 1, 2, 4 measured; alpha-beta predictions to 1024 workers"
        )
    )
    from sparktrain.bench.overlap import add_arguments as add_overlap_arguments

    add_overlap_arguments(
        bench_sub.add_parser("overlap", help="step time with overlap on/off, ring and ps")
    )
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    for noisy in ("py4j", "pyspark"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        return int(args.func(args))
    except SparkTrainError as exc:
        print(f"sparktrain: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
