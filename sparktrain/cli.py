"""The ``sparktrain`` command line (also behind ``spark-submit jobs/*.py``).

    sparktrain train CONFIG.toml [--set key=value ...] [--master URL] [--summary-json PATH]
    sparktrain bench NAME ...   (from a checkout of the repository: benchmarks/cli.py)

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
from pathlib import Path
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
    from sparktrain.driver.job import check_job
    from sparktrain.session import get_or_create_session
    from sparktrain.trainer import Trainer

    values = apply_overrides(load_toml(args.config), args.set or [])
    job, rest = split_job_keys(values)
    config = TrainConfig.from_dict(rest)
    check_job(config)  # what the strategy makes of the config, before Spark starts
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


# `sparktrain bench ...` runs the benchmark suite of a checkout of the repository: the
# top-level `benchmarks` package, which the installed package does not contain.
BENCH_HELP = "the benchmarks, from a checkout of the repository (sparktrain bench --help)"
NO_CHECKOUT = (
    "the benchmarks are not part of the installed package: clone sparktrain's repository "
    "and run `./dev bench {args}` (or `python -m benchmarks {args}`) from its root"
)


def checkout_candidates() -> list[Path]:
    """Where ``sparktrain bench`` looks for a checkout: the directory above the imported
    ``sparktrain`` package (an editable install, or a checkout on the path), then the
    current directory."""
    import sparktrain

    return [Path(sparktrain.__file__).resolve().parents[1], Path.cwd()]


def benchmarks_root(candidates: Sequence[Path] | None = None) -> Path | None:
    """The checkout whose ``benchmarks/`` suite ``sparktrain bench`` runs: the first of
    ``candidates`` (default :func:`checkout_candidates`) holding ``benchmarks/cli.py``;
    ``None`` for a wheel's install run outside a checkout."""
    for root in checkout_candidates() if candidates is None else candidates:
        if (root / "benchmarks" / "__init__.py").is_file() and (
            root / "benchmarks" / "cli.py"
        ).is_file():
            return root.resolve()
    return None


def run_benchmarks(argv: Sequence[str], root: Path | None = None) -> int:
    """``sparktrain bench ARGV``: ``benchmarks.cli.main(ARGV)`` of the checkout at ``root``
    (default :func:`benchmarks_root`); an error that says what to do when there is none."""
    root = benchmarks_root() if root is None else root
    shown = " ".join(argv) or "--help"
    if root is None or not (root / "benchmarks" / "cli.py").is_file():
        raise SparkTrainError(NO_CHECKOUT.format(args=shown))
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    loaded = sys.modules.get("benchmarks")
    if loaded is not None and Path(loaded.__file__ or "").resolve().parent != root / "benchmarks":
        raise SparkTrainError(
            f"another `benchmarks` package is already imported ({loaded.__file__}); "
            f"run `python -m benchmarks {shown}` from {root}"
        )
    # importlib, not a plain import: the core never imports the benchmarks at module level
    bench_cli = importlib.import_module("benchmarks.cli")
    return int(bench_cli.main(list(argv)))


def _bench_argv(argv: Sequence[str]) -> list[str] | None:
    """The benchmark's arguments when ``argv`` is ``[-v] bench ...``, else ``None`` (the
    top-level options take no values, so the first positional word is the command)."""
    words = [a for a in argv if not a.startswith("-")]
    if not words or words[0] != "bench":
        return None
    at = list(argv).index("bench")
    top = argv[:at]
    if any(a not in ("-v", "--verbose") for a in top):
        return None  # --help, --version: the top-level parser answers
    return (["-v"] if top else []) + list(argv[at + 1 :])


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser (``bench``'s arguments are the checkout's: see
    :func:`run_benchmarks`)."""
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

    # listed for --help only: main() hands `bench ...` to run_benchmarks before parsing
    sub.add_parser("bench", help=BENCH_HELP, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    bench_argv = _bench_argv(argv)
    if bench_argv is not None:
        try:
            return run_benchmarks(bench_argv)
        except SparkTrainError as exc:  # no checkout
            print(f"sparktrain: error: {exc}", file=sys.stderr)
            return 2
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
