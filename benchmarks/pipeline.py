"""Pipeline schedules compared: step time and peak activation memory of GPipe vs 1F1B.

Runs every stage as a thread of this process (real sockets on loopback, the real stage
loop of :mod:`sparktrain.parallel.stage`, no Spark), for each pipeline depth P, on a
deep MLP over synthetic data::

    sparktrain bench pipeline --stages 2 4 --micro-batches 8 --json results/pipeline.json

*Peak activation memory* is, per stage, the most bytes held at once for backward by the
micro-batches in flight (tensors autograd saved, plus each micro-batch's input and
output; parameters excluded), measured with ``torch.autograd.graph.saved_tensors_hooks``;
the table shows the largest stage's. *Step time* is the median over steps of the slowest
stage. Threads share the machine's cores, so absolute times are indicative; the
memory figures are exact.
"""

from __future__ import annotations

import argparse
import functools
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sparktrain.config import TrainConfig
from sparktrain.data.partition_data import PartitionData
from sparktrain.errors import ConfigError
from sparktrain.models import mlp
from sparktrain.parallel.partition import partition
from sparktrain.parallel.schedule import ideal_bubble
from sparktrain.parallel.stage import PipelineSpec, train_stage
from sparktrain.result import Record
from sparktrain.task.context import JobSpec, WorkerContext


class _Collectives:
    def __init__(self, world: int, timeout: float) -> None:
        self._barrier = threading.Barrier(world, timeout=timeout)
        self._slots: list[str] = [""] * world

    def barrier(self) -> None:
        self._barrier.wait()

    def all_gather(self, rank: int, message: str) -> list[str]:
        self._slots[rank] = message
        self._barrier.wait()
        out = list(self._slots)
        self._barrier.wait()
        return out


def run_threads(
    spec: PipelineSpec, parts: list[PartitionData], timeout: float = 600.0
) -> list[Record]:
    """Every rank of ``spec`` as a thread; returns all records (re-raises a failure)."""
    world = len(parts)
    coll = _Collectives(world, timeout)
    out: list[list[Record]] = [[] for _ in range(world)]
    errors: list[BaseException] = []

    def body(rank: int) -> None:
        ctx = WorkerContext(
            rank,
            world,
            "127.0.0.1",
            functools.partial(coll.all_gather, rank),
            coll.barrier,
            spec.job,
        )
        try:
            out[rank] = train_stage(ctx, parts[rank], spec)
        except BaseException as exc:
            errors.append(exc)
            coll._barrier.abort()

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if real or errors:
        raise (real or errors)[0]
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"the pipeline did not finish within {timeout} s")
    return [r for rs in out for r in rs]


def bench_one(
    stages: int,
    schedule: str,
    micro: int,
    *,
    width: int,
    hidden: int,
    depth: int,
    batch: int,
    steps: int,
    seed: int = 0,
) -> dict[str, Any]:
    """One pipeline run; returns its figures."""
    model_fn: Callable[[], torch.nn.Module] = functools.partial(mlp, width, [hidden] * depth, 10)
    cfg = TrainConfig(
        epochs=1,
        batch_size=batch,
        lr=0.01,
        optimizer="sgd",
        shuffle=False,
        progress=False,
        num_workers=stages,
        parallelism_pipeline=stages,
        parallelism_data=1,
        comm_timeout=120.0,
    )
    job = JobSpec(
        job_id="bench",
        attempt=0,
        secret=bytes(32),
        config=cfg,
        model_fn=model_fn,
        model_kwargs={},
        feature_width=width,
        num_outputs=10,
    )
    torch.manual_seed(seed)
    part = partition(model_fn(), stages, width, balance="params")
    spec = PipelineSpec(job, part, 1, micro, schedule)
    rng = np.random.default_rng(seed)
    rows = batch * steps // stages
    parts = [
        PartitionData(
            rng.standard_normal((rows, width)).astype(np.float32),
            rng.integers(0, 10, rows).astype(np.float64),
            np.zeros(rows, bool),
        )
        for _ in range(stages)
    ]
    records = run_threads(spec, parts)
    stats = [json.loads(r.data) for r in records if r.kind == "stats"]
    step = max(s["step_s_median"] for s in stats)
    busy = sum(s["busy_s"] for s in stats)
    total = max(s["step_s_total"] for s in stats)
    return {
        "stages": stages,
        "schedule": schedule,
        "micro_batches": micro,
        "batch_size": batch,
        "model": f"mlp({width}, [{hidden}] x {depth}, 10)",
        "steps": max(s["steps"] for s in stats),
        "step_ms": step * 1e3,
        "peak_activation_mib": max(s["peak_activation_bytes"] for s in stats) / (1 << 20),
        "peak_activation_mib_per_stage": [
            s["peak_activation_bytes"] / (1 << 20) for s in sorted(stats, key=lambda s: s["stage"])
        ],
        "peak_in_flight": max(s["peak_in_flight"] for s in stats),
        "bubble_measured": max(0.0, 1.0 - busy / (len(stats) * total)) if total else 0.0,
        "bubble_ideal": ideal_bubble(stages, micro),
        "stage_bytes_per_step": sum(s["stage_bytes_sent"] for s in stats)
        / max(1, max(s["steps"] for s in stats)),
    }


def table(records: list[dict[str, Any]]) -> str:
    """The records as a Markdown table."""
    lines = [
        "| P | micro-batches | schedule | step time (ms) | peak activations (MiB, worst stage) "
        "| max in flight | bubble (measured / ideal) | bytes between stages per step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        lines.append(
            f"| {r['stages']} | {r['micro_batches']} | {r['schedule']} | {r['step_ms']:.1f} "
            f"| {r['peak_activation_mib']:.2f} | {r['peak_in_flight']} "
            f"| {r['bubble_measured']:.2f} / {r['bubble_ideal']:.2f} "
            f"| {r['stage_bytes_per_step'] / 1e6:.2f} MB |"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8, help="hidden layers")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json", metavar="PATH", help="write the records here")
    parser.add_argument("--markdown", metavar="PATH", help="write the table here")


def main(args: argparse.Namespace) -> int:
    if any(p < 2 for p in args.stages):
        raise ConfigError("--stages must be >= 2")
    records = []
    for stages in args.stages:
        for schedule in ("gpipe", "1f1b"):
            records.append(
                bench_one(
                    stages,
                    schedule,
                    args.micro_batches,
                    width=args.width,
                    hidden=args.hidden,
                    depth=args.depth,
                    batch=args.batch_size,
                    steps=args.steps,
                )
            )
            print(f"P={stages} {schedule}: done", flush=True)
    text = table(records)
    print(text)
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(records, indent=1) + "\n")
        print(f"records written to {path}")
    if args.markdown:
        path = Path(args.markdown)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
        print(f"table written to {path}")
    return 0
