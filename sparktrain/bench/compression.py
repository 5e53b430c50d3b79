"""Compression speed benchmark: compress + decompress throughput of each spec.

    sparktrain bench compression --specs fp16 bf16 int8 topk:0.01 topk:0.01,sampled \
        --elements 16M --threads 2 --json runs/bench_compression.json

Throughput is ``4 * elements`` bytes (the fp32 input) over the median time of
``compress`` then ``decompress`` on one float32 vector (no network); ``ratio`` is the
fp32 size over the payload bytes actually produced. Runs in this process with
``torch.set_num_threads(--threads)``. A benchmark, not a test: nothing is asserted.
(The quality part — accuracy against bytes per compressor and strategy — comes with the
ps/tree_aggregate wiring.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from sparktrain.bench.allreduce import parse_size
from sparktrain.compress.base import BucketState, build
from sparktrain.errors import ConfigError

DEFAULT_SPECS = [
    "fp16",
    "bf16",
    "int8",
    "int8:stochastic",
    "topk:0.01",
    "topk:0.01,sampled",
    "randomk:0.01",
    "sign",
    "powersgd:2",
]


def bench_spec(spec: str, elements: int, repeats: int) -> dict[str, Any]:
    comp = build(spec)
    if comp is None:
        raise ConfigError("nothing to measure for compression='none'")
    x = torch.randn(elements)
    state = BucketState()
    times_c, times_d = [], []
    nbytes = 0
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        payload, ctx = comp.compress(x, state)
        t1 = time.perf_counter()
        comp.decompress(payload, ctx)
        t2 = time.perf_counter()
        state.step += 1
        if i:  # the first round warms up allocators and caches
            times_c.append(t1 - t0)
            times_d.append(t2 - t1)
        nbytes = sum(p.nbytes for p in payload)
    c, d = statistics.median(times_c), statistics.median(times_d)
    return {
        "spec": comp.spec,
        "elements": elements,
        "compress_s": c,
        "decompress_s": d,
        "gb_per_s": 4 * elements / (c + d) / 1e9,
        "payload_bytes": nbytes,
        "ratio": 4 * elements / max(nbytes, 1),
        "threads": torch.get_num_threads(),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--specs", nargs="+", default=DEFAULT_SPECS)
    parser.add_argument("--elements", default="16M", help="float32 elements, e.g. 1M, 16M")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    parser.add_argument("--json", metavar="PATH", help="write the records here")


def main(args: argparse.Namespace) -> int:
    text = args.elements  # "16M" means 16 Mi elements here
    elements = parse_size(text) if text[-1:].isalpha() else int(text)
    if elements < 1 or args.repeats < 1:
        raise ConfigError("--elements and --repeats must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    records = []
    print(f"{'spec':<24}{'compress ms':>12}{'decompress ms':>15}{'GB/s':>8}{'ratio':>9}")
    for spec in args.specs:
        rec = bench_spec(spec, elements, args.repeats)
        records.append(rec)
        print(
            f"{rec['spec']:<24}{rec['compress_s'] * 1e3:>12.1f}{rec['decompress_s'] * 1e3:>15.1f}"
            f"{rec['gb_per_s']:>8.2f}{rec['ratio']:>9.1f}",
            flush=True,
        )
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(records, indent=2) + "\n")
    return 0
