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
    sparktrain bench data --out docs/results
    sparktrain bench infer --json docs/results/bench_infer.json
    sparktrain bench sparse --json docs/results/bench_sparse.json
    sparktrain bench multihost --rate-mbit 100 --json docs/results/bench_multihost.json

A training config is a TrainConfig (top-level keys) plus a ``[job]`` table that says what
to train on: ``model`` ("package.module:function"), ``model_kwargs``, ``dataset`` and
``dataset_kwargs``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from sparktrain import __version__
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
    spark = get_or_create_session(
        args.master or default_master(config.num_workers), app_name=job["app_name"]
    )
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


def default_master(num_workers: int) -> str | None:
    """``local[num_workers]``: one slot per worker, as a barrier stage needs. ``None`` (the
    master spark-submit or a Connect session already chose) when this process runs under
    ``spark-submit`` (``PYSPARK_GATEWAY_PORT``) or with ``SPARK_REMOTE`` set."""
    if os.environ.get("PYSPARK_GATEWAY_PORT") or os.environ.get("SPARK_REMOTE"):
        return None
    return f"local[{num_workers}]"


# Each benchmark: (module under sparktrain.bench, help line). The modules import torch,
# Spark and matplotlib, so they are imported only when their benchmark is asked for:
# `sparktrain --help` and `sparktrain train --help` then import neither torch nor pyspark.
BENCHES: dict[str, tuple[str, str]] = {
    "allreduce": ("allreduce", "ring/tree allreduce vs torch Gloo"),
    "ps": ("ps", "parameter server: async/ssp, staleness_lr on/off"),
    "compression": (
        "compression",
        "compressor speed (GB/s), ratio; --quality: accuracy vs bytes",
    ),
    "mllib": ("mllib", "tree_aggregate vs MLlib's MLP (L-BFGS) on digits"),
    "train": ("train", "every strategy x compressor vs TorchDistributor and MLlib, same run"),
    "report": ("report", "regenerate README's results section from the JSON"),
    "pipeline": ("pipeline", "GPipe vs 1F1B: step time, activation memory"),
    "scaling": ("scaling", "worlds 1, 2, 4 measured; alpha-beta predictions to 1024 workers"),
    "overlap": ("overlap", "step time with overlap on/off, ring and ps"),
    "multihost": (
        "multihost",
        "2 workers in network namespaces, links shaped by tc tbf: every strategy and DDP; "
        "own link emulation vs tbf (root)",
    ),
    "infer": ("infer", "batch inference: transform vs pyspark's predict_batch_udf, same run"),
    "sparse": (
        "sparse",
        "two-tower recommender, 1M x 64 table: dense ring vs sparse ring/ps vs DDP, same run",
    ),
    "data": (
        "data",
        "data path: worker memory and samples/s, in RAM vs spilled, prefetch on/off, "
        "vs a Petastorm/pyarrow peer",
    ),
}
# what a benchmark may import that only the `bench` extra installs
BENCH_EXTRA_MODULES = ("matplotlib", "sklearn")


def bench_module(name: str) -> Any:
    """Import ``sparktrain.bench.<module>`` for benchmark ``name``; a missing extra gets an
    error that names it."""
    try:
        return importlib.import_module(f"sparktrain.bench.{BENCHES[name][0]}")
    except ModuleNotFoundError as exc:
        _raise_if_extra_missing(exc)
        raise


def _raise_if_extra_missing(exc: ModuleNotFoundError) -> None:
    if (exc.name or "").partition(".")[0] in BENCH_EXTRA_MODULES:
        raise SparkTrainError(
            f"the benchmarks need {exc.name}, which is not installed: "
            "pip install 'sparktrain[bench]'"
        ) from exc


def cmd_bench(args: argparse.Namespace) -> int:
    if args.what not in BENCHES:
        raise SparkTrainError(f"unknown benchmark {args.what!r}; available: {', '.join(BENCHES)}")
    try:
        return int(bench_module(args.what).main(args))
    except ModuleNotFoundError as exc:  # a plot's lazy `import matplotlib`
        _raise_if_extra_missing(exc)
        raise


def wanted_bench(argv: Sequence[str]) -> str | None:
    """The benchmark ``argv`` runs (``bench NAME ...``), if any: only its module is imported
    to build its arguments. Top-level options take no values, so the first two positional
    words are the command and the benchmark."""
    words = [a for a in argv if not a.startswith("-")]
    if len(words) >= 2 and words[0] == "bench":
        return words[1]
    return None


def build_parser(bench: str | None = "*") -> argparse.ArgumentParser:
    """The command line's parser. ``bench`` says which benchmark's arguments to add (its
    module is imported for them): ``"*"`` all, ``None`` none (they then parse as the
    benchmark's name only, enough for ``--help`` and for the other commands)."""
    parser = argparse.ArgumentParser(prog="sparktrain", description=__doc__.split("\n\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"sparktrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a model described by a TOML config")
    train.add_argument("config", help="TOML file, e.g. conf/digits_mlp.toml")
    train.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="override a config key (repeatable; dotted for tables)",
    )
    train.add_argument(
        "--master",
        help="Spark master URL (default: spark-submit's, else local[N] with N = num_workers)",
    )
    train.add_argument("--summary-json", metavar="PATH", help="write the run's summary here")
    train.set_defaults(func=cmd_train)

    bench_parser = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench_parser.add_subparsers(dest="what", required=True)
    for name, (_, help_line) in BENCHES.items():
        sub_parser = bench_sub.add_parser(name, help=help_line)
        if bench in ("*", name):
            bench_module(name).add_arguments(sub_parser)
    bench_parser.set_defaults(func=cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        parser = build_parser(bench=wanted_bench(argv))
    except SparkTrainError as exc:  # a benchmark's extra is missing
        print(f"sparktrain: error: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
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
