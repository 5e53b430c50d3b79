"""The benchmarks' command line: ``sparktrain bench NAME ...`` (from a checkout),
``python -m benchmarks NAME ...`` and ``./dev bench NAME ...`` from the repository's root.

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
    sparktrain bench defaults --json docs/results/bench_defaults.json
    sparktrain bench defaults-ceiling --json docs/results/defaults_ceiling.json
    sparktrain bench headline --links 5g --seeds 0 1 2 --json docs/results/bench_headline5g.json
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import MutableMapping, Sequence
from pathlib import Path
from typing import Any

from sparktrain.errors import SparkTrainError

# the repository's root: what Spark's Python workers, torchrun's ranks and the benchmarks'
# child processes need on their path to import this package
ROOT = Path(__file__).resolve().parents[1]

# Each benchmark: (module under benchmarks, help line). The modules import torch, Spark and
# matplotlib, so they are imported only when their benchmark is asked for: `sparktrain
# bench --help` then imports neither torch nor pyspark.
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
    "headline": (
        "headline",
        "issue 36.1: time to accuracy on slow links, 5.3 M-parameter MLP: every compressor, "
        "auto and DDP (plain, fp16 and PowerSGD hooks); 5g emulated, tbf:RATE namespaces",
    ),
    "defaults": (
        "defaults",
        "TrainConfig's defaults vs MLlib's on scikit-learn's data sets (digits, breast "
        "cancer, diabetes, ...), old defaults too",
    ),
    "defaults-ceiling": (
        "defaults_ceiling",
        "no Spark: the defaults' fits emulated in plain torch against AdamW, early stopping, "
        "cosine decay and a linear model; the best-epoch ceiling",
    ),
}
# what a benchmark may import that only the `bench` extra installs
BENCH_EXTRA_MODULES = ("matplotlib", "sklearn")


def bench_module(name: str) -> Any:
    """Import ``benchmarks.<module>`` for benchmark ``name``; a missing extra gets an error
    that names it."""
    try:
        return importlib.import_module(f"benchmarks.{BENCHES[name][0]}")
    except ModuleNotFoundError as exc:
        _raise_if_extra_missing(exc)
        raise


def _raise_if_extra_missing(exc: ModuleNotFoundError) -> None:
    if (exc.name or "").partition(".")[0] in BENCH_EXTRA_MODULES:
        raise SparkTrainError(
            f"the benchmarks need {exc.name}, which is not installed: "
            "pip install -e '.[bench]' in the repository's root"
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
    """The benchmark ``argv`` runs (``NAME ...``), if any: only its module is imported to
    build its arguments. The top-level options take no values, so the first positional word
    is the benchmark."""
    words = [a for a in argv if not a.startswith("-")]
    return words[0] if words else None


def build_parser(
    bench: str | None = "*", prog: str = "sparktrain bench"
) -> argparse.ArgumentParser:
    """The benchmarks' parser (``NAME [options]``). ``bench`` says which benchmark's
    arguments to add (its module is imported for them): ``"*"`` all, ``None`` none (they
    then parse as the benchmark's name only, enough for ``--help``)."""
    parser = argparse.ArgumentParser(
        prog=prog, description="sparktrain's benchmarks, run from a checkout of the repository"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    bench_sub = parser.add_subparsers(dest="what", required=True, metavar="NAME")
    for name, (_, help_line) in BENCHES.items():
        sub_parser = bench_sub.add_parser(name, help=help_line)
        if bench in ("*", name):
            bench_module(name).add_arguments(sub_parser)
    parser.set_defaults(func=cmd_bench)
    return parser


def export_root(environ: MutableMapping[str, str] = os.environ) -> None:
    """Put the repository's root on ``PYTHONPATH`` (first), so that the processes this one
    starts import ``benchmarks`` too: Spark's Python workers and JVMs started from here,
    torchrun's ranks, ``bench train``'s child processes."""
    path = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(ROOT) not in path:
        environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *path])


def main(argv: Sequence[str] | None = None, prog: str = "sparktrain bench") -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        parser = build_parser(bench=wanted_bench(argv), prog=prog)
    except SparkTrainError as exc:  # a benchmark's extra is missing
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    for noisy in ("py4j", "pyspark"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    export_root()
    try:
        return int(args.func(args))
    except SparkTrainError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
