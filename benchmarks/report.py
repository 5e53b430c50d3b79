"""Regenerate the results page (``docs/results.md``) from the benchmarks' JSON files.

    sparktrain bench report                  # rewrite docs/results.md between the markers
    sparktrain bench report --check          # exit 1 when the page's section is stale
    sparktrain bench report --print          # the section on stdout, the page untouched

Every benchmark writes JSON (and most a PNG) under one folder (``--results``, default
``docs/results``). This command renders one subsection per benchmark — the command that
produced it, a table built from the JSON by the benchmark's own ``table`` function, the
plot — plus a description of the machine and today's date, and replaces the page's text
between ``<!-- results:begin -->`` and ``<!-- results:end -->``. A missing file gives a
"not run" line instead of a table.

Prose that interprets the figures is written by people and kept next to the data:
``RESULTS/notes/<key>.before.md`` (method, shown above the table) and
``RESULTS/notes/<key>.after.md`` (what the figures mean, shown below it). Whoever reruns a
benchmark should reread its notes.

``--check`` compares the section without its machine-and-date block, so a check on another
machine or day fails only when the figures, notes or layout changed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparktrain.errors import SparkTrainError

BEGIN = "<!-- results:begin -->"
END = "<!-- results:end -->"
MACHINE_BEGIN = "<!-- results:machine:begin -->"
MACHINE_END = "<!-- results:machine:end -->"
DEFAULT_PAGE = "docs/results.md"


# ---------------------------------------------------------------------- renderers
def _digits(data: Any) -> str:
    s = data
    return "\n".join(
        [
            "| strategy | test accuracy | wall | training loop | bytes sent | on the wire |",
            "|---|---:|---:|---:|---:|---:|",
            f"| {s['strategy']} | {s['metric_value']:.4f} | {s['wall_s']:.1f} s "
            f"| {s['train_s']:.2f} s | {s['bytes_sent'] / 1e6:.1f} MB "
            f"| {s['wire_bytes'] / 1e6:.1f} MB |",
        ]
    )


def _allreduce(data: Any) -> str:
    from benchmarks import allreduce

    return allreduce.table(data)


def _ps(data: Any) -> str:
    from benchmarks import ps

    return ps.table(data)


def _mllib(data: Any) -> str:
    from benchmarks import mllib

    return mllib.table(data)


def _pipeline(data: Any) -> str:
    from benchmarks import pipeline

    return pipeline.table(data)


def _compression(data: Any) -> str:
    from benchmarks import compression

    return compression.quality_table(data)


def _compression_worlds(data: Any) -> str:
    from benchmarks import compression_worlds

    return compression_worlds.render(data)


def _compression_shipped(data: Any) -> str:
    from benchmarks import compression_worlds

    return compression_worlds.render_shipped(data)


def _per_layer(data: Any) -> str:
    from benchmarks import compression

    return compression.per_layer_table(data)


def _speed(data: Any) -> str:
    lines = [
        "| spec | elements | compress ms | decompress ms | GB/s (compress+decompress) | ratio |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in data:
        lines.append(
            f"| `{r['spec']}` | {r['elements']:,} | {r['compress_s'] * 1e3:.1f} "
            f"| {r['decompress_s'] * 1e3:.1f} | {r['gb_per_s']:.2f} | {r['ratio']:.1f} |"
        )
    return "\n".join(lines)


def _train(data: Any) -> str:
    from benchmarks import train

    parts = [train.table(data)]
    derived = data.get("derived", {})
    verdicts = []
    head = derived.get("ring_vs_torchdistributor")
    if head:
        verdicts.append(
            f"- ring / TorchDistributor, whole process to {data['target']:.2f} accuracy: "
            f"{_num(head['ring_whole_process_to_target_s'], '{:.1f} s')} / "
            f"{_num(head['torchdistributor_whole_process_to_target_s'], '{:.1f} s')} = "
            f"{_num(head['ratio'], '{:.2f}')} (target {head.get('target', '<= 0.5')}: "
            f"{_met(head['met'])}){_load(head)}"
        )
        if head.get("floor_ratio") is not None:
            verdicts.append(
                f"- the floor under that target: a fresh Python process that only starts "
                f"the SparkSession and stops it takes "
                f"{_num(head['session_only_process_s'], '{:.1f} s')} = "
                f"{_num(head['floor_ratio'], '{:.2f}')} x TorchDistributor's whole process "
                f"(the session is up {_num(head['session_ready_s'], '{:.1f} s')} after "
                f"spawn). From that point to {data['target']:.2f} accuracy: ring "
                f"{_num(head['ring_after_session_s'], '{:.1f} s')}, TorchDistributor "
                f"{_num(head['torchdistributor_after_session_s'], '{:.1f} s')} = "
                f"{_num(head['after_session_ratio'], '{:.2f}')}"
            )
    for row in derived.get("whole_process_vs_peers", []):
        verdicts.append(
            f"- {row['ours']} / {row['peer']}, whole process (spawn to exit) on digits: "
            f"{_num(row['ours_whole_s'], '{:.1f} s')} / {_num(row['peer_whole_s'], '{:.1f} s')}"
            f" = {_num(row['whole_ratio'], '{:.2f}')}; spawn to {data['target']:.2f} accuracy: "
            f"{_num(row['ours_to_target_s'], '{:.1f} s')} / "
            f"{_num(row['peer_to_target_s'], '{:.1f} s')} = "
            f"{_num(row['to_target_ratio'], '{:.2f}')} (medians of {row['runs']}){_load(row)}"
        )
    warm = derived.get("ring_vs_torchdistributor_warm")
    if warm:
        target = f" (target {warm['target']}: {_met(warm['met'])})" if "target" in warm else ""
        verdicts.append(
            f"- the same, second call in the already-running process (as in a notebook): "
            f"ring fit() / TorchDistributor run() to "
            f"{data['target']:.2f}: {_num(warm['ring_time_to_target_s'], '{:.1f} s')} / "
            f"{_num(warm['torchdistributor_time_to_target_s'], '{:.1f} s')} = "
            f"{_num(warm['ratio'], '{:.2f}')}{target}"
        )
    memory = derived.get("memory_vs_torchdistributor")
    if memory:
        verdicts.append(
            f"- peak memory of the Python processes (summed PSS, JVMs left out), ring's "
            f"first fit / TorchDistributor's first run on digits: "
            f"{_num(memory['ring_peak_pss_bytes'], '{:.0f}', 1e-6)} MB / "
            f"{_num(memory['torchdistributor_peak_pss_bytes'], '{:.0f}', 1e-6)} MB = "
            f"{_num(memory['ratio'], '{:.2f}')} (target {memory['target']}: "
            f"{_met(memory['met'])}); summed RSS: "
            f"{_num(memory['ring_peak_rss_bytes'], '{:.0f}', 1e-6)} MB / "
            f"{_num(memory['torchdistributor_peak_rss_bytes'], '{:.0f}', 1e-6)} MB = "
            f"{_num(memory['rss_ratio'], '{:.2f}')}; the session-only process: "
            f"{_num(memory['session_only_peak_pss_bytes'], '{:.0f}', 1e-6)} MB PSS"
        )
    steady = derived.get("steady_vs_ddp")
    if steady:
        verdicts.append(
            f"- steady-state samples/s on the synthetic MLP, ring / DDP (TorchDistributor), "
            f"medians of {steady['runs']} interleaved runs each: "
            f"{_num(steady['ring_samples_per_s'], '{:,.0f}')} / "
            f"{_num(steady['ddp_samples_per_s'], '{:,.0f}')} = "
            f"{_num(steady['ratio'], '{:.2f}')} (target {steady['target']}: "
            f"{_met(steady['met'])}){_load(steady)}"
            + (
                f"; the compute floor (the same steps with no exchange at all): "
                f"{_num(steady['compute_only_samples_per_s'], '{:,.0f}')} = "
                f"{_num(steady['compute_only_ratio'], '{:.2f}')} x DDP"
                if steady.get("compute_only_samples_per_s") is not None
                else ""
            )
        )
    pair = derived.get("tree_aggregate_vs_mllib")
    if pair:
        verdicts.append(
            f"- tree_aggregate / MLlib MLP, time to {data['target']:.2f}: "
            f"{_num(pair['tree_aggregate_time_to_target_s'], '{:.1f} s')} / "
            f"{_num(pair['mllib_time_to_target_s'], '{:.1f} s')} = "
            f"{_num(pair['ratio'], '{:.2f}')} (target <= 1: {_met(pair['met'])})"
        )
    if verdicts:
        parts += ["", *verdicts]
    if any(str(r.get("compression", "")).startswith("delta+") for r in data["runs"]):
        parts += [
            "",
            "`delta+<spec>` rows (parameter server, tree_aggregate): the weights the driver "
            "sends are compressed as deltas too. Bytes and ratios count both directions "
            "for these strategies, with or without `delta+`.",
        ]
    rows = derived.get("compression_vs_ideal") or []
    if rows:
        parts += [
            "",
            "Under the 5g link: compression's saving in training time against the ideal "
            "1 - 1/ratio, judged where moving the uncompressed run's bytes at the link's "
            "bandwidth takes at least half of its training time (compression shrinks bytes, "
            "not round trips; target >= 70 % of the ideal). comm share: the measured "
            "communication time's share; bytes share: the bandwidth-bound part's.",
            "",
            "| workload | strategy | compression | train s (none) | train s | comm share (none) "
            "| bytes share (none) | ratio | saving | ideal | of ideal | target |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in rows:
            target = "-" if r["met"] is None else _met(r["met"])
            parts.append(
                f"| {r['workload']} | {r['strategy']} | `{r['compression']}` "
                f"| {r['train_s_none']:.2f} | {r['train_s']:.2f} "
                f"| {_num(r['comm_share_none'], '{:.0%}')} "
                f"| {_num(r.get('transfer_share_none'), '{:.0%}')} | {r['ratio']:.1f} "
                f"| {r['saving']:.0%} | {r['ideal_saving']:.0%} "
                f"| {_num(r['fraction_of_ideal'], '{:.0%}')} | {target} |"
            )
    autos = derived.get("auto_vs_best") or []
    if autos:
        parts += [
            "",
            "| workload | link | measure | auto | auto chose | best fixed | best | gap | target |",
            "|---|---|---|---:|---|---|---:|---:|---|",
        ]
        for r in autos:
            chose = r.get("auto_chose") or {}
            parts.append(
                f"| {r['workload']} | {r['link']} | {r['measure']} | {r['auto']:.2f} "
                f"| {chose.get('strategy', '?')} / `{chose.get('compression', '?')}` "
                f"| {' / '.join(r['best_fixed'])} | {r['best_fixed_score']:.2f} "
                f"| {r['gap']:+.0%} | {_met(r['met'])} (<= 10 %) |"
            )
    return "\n".join(parts)


def _steady(data: Any) -> str:
    from benchmarks import train

    return train.steady_table(data)


def _overlap(data: Any) -> str:
    from benchmarks import overlap

    return str(overlap.table(data["records"]))


def _data(data: Any) -> str:
    from benchmarks import data as data_bench

    return data_bench.table(data)


def _infer(data: Any) -> str:
    from benchmarks import infer

    return infer.table(data)


def _sparse(data: Any) -> str:
    from benchmarks import sparse

    return sparse.table(data)


def _defaults(data: Any) -> str:
    from benchmarks import defaults

    return defaults.table(data)


def _defaults_ceiling(data: Any) -> str:
    from benchmarks import defaults_ceiling

    return defaults_ceiling.table(data)


def _multihost(data: Any) -> str:
    from benchmarks import multihost

    return multihost.table(data)


def _headline(data: Any) -> str:
    from benchmarks import headline

    return headline.table(data)


def _scaling(data: Any) -> str:
    parts = []
    if data.get("oversubscription"):
        parts += [str(data["oversubscription"]), ""]
    measured = data.get("measured") or []
    if measured:
        parts += [
            "| world | oversubscription | step (measured) | of which exchange | model step "
            "| samples/s | speedup vs world 1 |",
            "|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in measured:
            parts.append(
                f"| {r['world']} | {r['oversubscription']:g}× | {r['step_s'] * 1e3:.1f} ms "
                f"| {r['comm_step_s'] * 1e3:.1f} ms | {r['predicted_step_s'] * 1e3:.1f} ms "
                f"| {r['samples_per_s']:,.0f} | {r['speedup']:.2f} |"
            )
        parts.append("")
    predictions = data.get("predictions") or []
    if predictions:
        if data.get("predictions_note"):
            parts += [str(data["predictions_note"]), ""]
        parts += [
            "| link | model | workers | ring | tree | ps | tree_aggregate |",
            "|---|---|---:|---:|---:|---:|---:|",
        ]
        for r in predictions:
            if r["world"] not in (8, 64, 1024):
                continue  # the plot has every size; the table keeps three
            parts.append(
                f"| {r['link']} | {r['model']} | {r['world']} | {_secs(r['ring_s'])} "
                f"| {_secs(r['tree_s'])} | {_secs(r['ps_s'])} | {_secs(r['tree_aggregate_s'])} |"
            )
    return "\n".join(parts).strip()


def _secs(value: float) -> str:
    return f"{value * 1e3:.2f} ms" if value < 1 else f"{value:.3g} s"


def _auto(data: Any) -> str:
    keep = ("link", "strategy", "compression", "chosen", "time_s", "metric", "wire_bytes")
    runs = [{k: r.get(k) for k in keep} for r in data.get("runs", [])]
    parts = [generic_table(runs)]
    reasons = [f"- {r['link']}: {r['reason']}" for r in data.get("runs", []) if r.get("reason")]
    if reasons:
        parts += ["", "Why auto chose what it chose:", "", *reasons]
    if data.get("verdicts"):
        parts += ["", generic_table(data["verdicts"])]
    return "\n".join(parts)


def _num(value: Any, pattern: str, scale: float = 1.0) -> str:
    return "-" if value is None else pattern.format(value * scale)


def _load(figure: dict[str, Any]) -> str:
    """ ", load average a-b" from a derived figure's recorded 1-minute load averages."""
    spread = figure.get("load_avg_1m")
    return f", load average {spread[0]:.1f}-{spread[1]:.1f}" if spread else ""


def _met(flag: Any) -> str:
    return "met" if flag else "MISSED"


def _cell(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return "-" if value is None else str(value).lower()
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list | tuple):
        return ", ".join(_cell(v) for v in value)
    return str(value).replace("|", "\\|")


def generic_table(rows: Any) -> str:
    """A markdown table of a list of flat dicts (nested values are left out)."""
    if isinstance(rows, dict):
        rows = [{"key": k, **v} if isinstance(v, dict) else {"key": k, "value": v}
                for k, v in rows.items()]  # fmt: skip
    rows = [r for r in rows if isinstance(r, dict)]
    if not rows:
        return "(no rows)"
    keys: list[str] = []
    for r in rows:
        keys += [k for k, v in r.items() if k not in keys and not isinstance(v, dict)]
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        lines.append("| " + " | ".join(_cell(r.get(k)) for k in keys) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------- sections
@dataclass(frozen=True)
class Section:
    """One benchmark's subsection: where its JSON is, how to render it, what made it."""

    key: str
    title: str
    command: str
    json_name: str
    render: Callable[[Any], str]
    images: tuple[str, ...] = field(default=())


SECTIONS: tuple[Section, ...] = (
    Section(
        "digits", "Digits, the main job",
        "./dev digits --summary-json docs/results/digits_ring.json", "digits_ring.json", _digits,
    ),
    Section(
        "allreduce", "Allreduce between barrier tasks against torch.distributed Gloo",
        "sparktrain bench allreduce --world 2 4 --sizes 4K 1M 16M 64M --algos ring tree gloo \\\n"
        "    --json docs/results/allreduce.json        "
        "# also: spark-submit benchmarks/submit.py allreduce ...",
        "allreduce.json", _allreduce, ("allreduce.png",),
    ),
    Section(
        "allreduce_ps", "One parameter-server round against one ring allreduce",
        "sparktrain bench allreduce --world 2 4 --sizes 1M 16M --algos ring ps --shards 1 4 \\\n"
        "    --json docs/results/allreduce_ps.json",
        "allreduce_ps.json", _allreduce,
    ),
    Section(
        "allreduce_torch", "comm_backend='torch': Gloo inside the barrier tasks",
        "sparktrain bench allreduce --world 2 --sizes 4K 1M 16M --algos ring torch gloo \\\n"
        "    --json docs/results/allreduce_torch.json",
        "allreduce_torch.json", _allreduce, ("allreduce_torch.png",),
    ),
    Section(
        "bench_train_torch", "comm_backend='torch' against the ring, whole fits",
        "sparktrain bench train --parts matrix --strategies ring ring-torch \\\n"
        "    --compressions none fp16 --links none --repeats 3 \\\n"
        "    --json docs/results/bench_train_torch.json",
        "bench_train_torch.json", _train, ("bench_train_torch.png",),
    ),
    Section(
        "bench_mllib", "tree_aggregate against MLlib's MultilayerPerceptronClassifier",
        "sparktrain bench mllib --json docs/results/bench_mllib.json",
        "bench_mllib.json", _mllib, ("bench_mllib.png",),
    ),
    Section(
        "bench_ps", "Parameter server: async and ssp, with and without staleness_lr",
        "sparktrain bench ps --world 2 --epochs 10 --seeds 0 1 2 --json docs/results/bench_ps.json",
        "bench_ps.json", _ps,
    ),
    Section(
        "bench_pipeline", "Pipeline schedules: GPipe against 1F1B",
        "sparktrain bench pipeline --stages 2 4 --micro-batches 8 "
        "--json docs/results/bench_pipeline.json",
        "bench_pipeline.json", _pipeline,
    ),
    Section(
        "compression_worlds", "Compression as the world grows: worlds 2, 4, 8, paired seeds",
        "sparktrain bench compression --quality --ablation --local-clip 1.8 --drop-last \\\n"
        "    --time-to 0.95 --link 5g --json docs/results/compression_worlds.json \\\n"
        "    --plot docs/results/compression_worlds.png",
        "compression_worlds.json", _compression_worlds, ("compression_worlds.png",),
    ),
    Section(
        "compression_shipped", "Top-k out of the box: the shipped configs at worlds 2, 4, 8",
        "sparktrain bench compression --quality --json docs/results/compression_shipped.json \\\n"
        "    --config conf/digits_mlp.toml conf/digits_cnn.toml\n"
        "# then, each with --add-to docs/results/compression_shipped.json --json (the same):\n"
        "sparktrain bench compression --quality --config conf/digits_mlp.toml \\\n"
        "    --force-paths allgather resparsify\n"
        "sparktrain bench compression --quality --specs topk:0.01+ef:momentum=0 \\\n"
        "    --force-paths resparsify --config conf/digits_mlp.toml conf/digits_cnn.toml\n"
        "sparktrain bench compression --quality --config conf/digits_cnn.toml --worlds 8 \\\n"
        "    --force-paths allgather",
        "compression_shipped.json", _compression_shipped,
    ),
    Section(
        "compression_defaults", "Top-k on the defaults: model, data, workers and `topk:0.01+ef`",
        "sparktrain bench compression --quality --config conf/digits_defaults.toml \\\n"
        "    --specs topk:0.01+ef --worlds 2 4 8 --json docs/results/compression_defaults.json",
        "compression_defaults.json", _compression_shipped,
    ),
    Section(
        "compression_quality", "Compression: accuracy against bytes",
        "sparktrain bench compression --quality --json docs/results/compression_quality.json \\\n"
        "    --plot docs/results/compression_quality.png",
        "compression_quality.json", _compression, ("compression_quality.png",),
    ),
    Section(
        "compression_quality_followup", "Compression follow-up: chunked sign, world 4, PS top-k",
        "sparktrain bench compression --quality --models mlp cnn --worlds 2 4 \\\n"
        "    --specs none int8+ef sign+ef sign:chunk=32+ef:momentum=0.9 topk:0.01+ef \\\n"
        "    --json docs/results/compression_quality_followup.json",
        "compression_quality_followup.json", _compression,
    ),
    Section(
        "compression_quality_droplast", "Sign compression with drop_last",
        "sparktrain bench compression --quality --drop-last --models mlp cnn \\\n"
        "    --strategies ring ps --specs none sign+ef sign:chunk=32+ef:momentum=0.9 \\\n"
        "    --json docs/results/compression_quality_droplast.json",
        "compression_quality_droplast.json", _compression,
    ),
    Section(
        "compression_per_layer", "Compression: per-layer sensitivity and a mixed policy",
        "sparktrain bench compression --per-layer --models mlp cnn --epochs 20 \\\n"
        "    --json docs/results/compression_per_layer.json",
        "compression_per_layer.json", _per_layer,
    ),
    Section(
        "compression_speed", "Compressor speed",
        "sparktrain bench compression --specs fp16 bf16 int8 topk:0.01,sampled topk:0.01 sign \\\n"
        "    --elements 16M --repeats 7 --threads 2 --json docs/results/compression_speed.json",
        "compression_speed.json", _speed,
    ),
    Section(
        "bench_train", "Head to head: every strategy and compressor, TorchDistributor, MLlib",
        "sparktrain bench train --include-auto --repeats 2 --out docs/results\n"
        "# the delta+ rows (first run); reproduce with:\n"
        "sparktrain bench train --parts matrix --strategies ps-sync ps-async tree_aggregate \\\n"
        "    --compressions delta+fp16 delta+int8+ef delta+topk:0.01+ef --repeats 2 --merge\n"
        "sparktrain bench train --parts matrix --strategies ps-sync ps-async tree_aggregate \\\n"
        "    --repeats 2 --merge --out docs/results\n"
        "sparktrain bench train --parts headline steady --repeats 3 --merge --out docs/results\n"
        "# also: spark-submit benchmarks/submit.py train",
        "bench_train.json", _train, ("bench_train.png",),
    ),
    Section(
        "bench_steady", "Steady state against DDP: worlds 2 and 4, fp32 and bf16",
        "sparktrain bench train --parts steady --steady-worlds 2 4 \\\n"
        "    --steady-precisions fp32 bf16 --repeats 3 --json docs/results/bench_steady.json",
        "bench_steady.json", _steady,
    ),
    Section(
        "bench_overlap", "Overlapping communication with the backward pass",
        "sparktrain bench overlap --strategies ring ps --out docs/results",
        "bench_overlap.json", _overlap, ("bench_overlap.png",),
    ),
    Section(
        "bench_overlap_lan", "Overlap on an emulated 1 Gbit/s link",
        "sparktrain bench overlap --name bench_overlap_lan_batch512 --link lan --batch 512 \\\n"
        "    --steps 10 --repeats 6 --out docs/results",
        "bench_overlap_lan_batch512.json", _overlap, ("bench_overlap_lan_batch512.png",),
    ),
    Section(
        "scaling", "Scaling: measured worlds and alpha-beta predictions",
        "sparktrain bench scaling --worlds 1 2 4 --links none 5g --out docs/results",
        "scaling.json", _scaling, ("scaling.png",),
    ),
    Section(
        "auto_vs_fixed", "auto against every fixed strategy and compressor",
        "sparktrain bench scaling --auto --links none 5g --out docs/results",
        "auto_vs_fixed.json", _auto,
    ),
    Section(
        "bench_data", "Data path: partitions bigger than the worker's budget",
        "sparktrain bench data --out docs/results",
        "bench_data.json", _data, ("bench_data.png",),
    ),
    Section(
        "bench_infer", "Batch inference: transform against predict_batch_udf",
        "sparktrain bench infer --json docs/results/bench_infer.json",
        "bench_infer.json", _infer,
    ),
    Section(
        "bench_sparse", "Sparse embeddings: a two-tower recommender's 1M x 64 table",
        "sparktrain bench sparse --json docs/results/bench_sparse.json",
        "bench_sparse.json", _sparse, ("bench_sparse.png",),
    ),
    Section(
        "bench_multihost", "Multi-host: workers in network namespaces, links shaped by tc tbf",
        "sparktrain bench multihost --rate-mbit 100 --repeats 3 \\\n"
        "    --json docs/results/bench_multihost.json   # as root\n"
        "sparktrain bench multihost --rate-mbit 100 --parts compare busbw --merge \\\n"
        "    --json docs/results/bench_multihost.json   # the last two tables",
        "bench_multihost.json", _multihost,
    ),
    Section(
        "bench_headline5g",
        "The 5G headline: time to accuracy on slow links, a 5.3 M-parameter MLP, against DDP",
        "sparktrain bench headline --links 5g --seeds 0 1 2 \\\n"
        "    --json docs/results/bench_headline5g.json                # local[2], emulated\n"
        "sparktrain bench headline --links tbf:100 tbf:1000 --seeds 0 --merge \\\n"
        "    --json docs/results/bench_headline5g.json --plot docs/results/bench_headline5g.png"
        "   # as root\n"
        "# then, each with --merge --json docs/results/bench_headline5g.json (the same):\n"
        "sparktrain bench headline --links tbf:100 --seeds 0 \\\n"
        "    --contenders ddp-powersgd powersgd auto                  # seed 0's rerun\n"
        "sparktrain bench headline --links tbf:100 tbf:1000 --seeds 1 2 \\\n"
        "    --contenders int8+ef powersgd auto ddp-fp16 ddp-powersgd   # run one link at a time",
        "bench_headline5g.json", _headline, ("bench_headline5g.png",),
    ),
    Section(
        "bench_defaults", "Defaults that train: TrainConfig's defaults against MLlib's",
        "sparktrain bench defaults --json docs/results/bench_defaults.json",
        "bench_defaults.json", _defaults,
    ),
    Section(
        "defaults_ceiling",
        "How far the default model goes: conventional settings, emulated, against a linear fit",
        "sparktrain bench defaults-ceiling --json docs/results/defaults_ceiling.json",
        "defaults_ceiling.json", _defaults_ceiling,
    ),
)  # fmt: skip


# ---------------------------------------------------------------------- machine
def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _version(module: str) -> str:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:
        return "not installed"


def _java() -> str:
    try:
        out = subprocess.run(
            ["java", "-version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return "not found"
    first = (out.stderr or out.stdout).strip().splitlines()
    return first[0] if first else "unknown"


def machine() -> dict[str, Any]:
    """CPU model and count, RAM, OS and the versions that matter to the figures."""
    cpuinfo = _read("/proc/cpuinfo")
    model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)
    mem = re.search(r"^MemTotal:\s*(\d+) kB", _read("/proc/meminfo"), re.M)
    os_name = re.search(r'^PRETTY_NAME="?([^"\n]+)"?', _read("/etc/os-release"), re.M)
    return {
        "cpu": model.group(1).strip() if model else platform.processor() or "unknown",
        "cpus": os.cpu_count(),
        "ram_gib": round(int(mem.group(1)) / (1 << 20), 1) if mem else None,
        "os": os_name.group(1) if os_name else platform.platform(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "pyspark": _version("pyspark"),
        "java": _java(),
    }


def machine_block(info: dict[str, Any], today: str) -> str:
    ram = f"{info['ram_gib']} GiB RAM" if info["ram_gib"] is not None else "RAM unknown"
    return "\n".join(
        [
            MACHINE_BEGIN,
            f"Generated by `sparktrain bench report` on {today} on {info['cpus']} × "
            f"{info['cpu']}, {ram}, {info['os']}; Python {info['python']}, torch "
            f"{info['torch']}, pyspark {info['pyspark']}, {info['java']}.",
            MACHINE_END,
        ]
    )


# ---------------------------------------------------------------------- the section
def render_section(section: Section, results: Path, link_prefix: str) -> str:
    """One subsection: heading, command, notes before, table, images, notes after."""
    notes = results / "notes"
    out = [f"### {section.title}", "", "```bash", section.command, "```", ""]
    before = _read(str(notes / f"{section.key}.before.md")).strip()
    if before:
        out += [before, ""]
    path = results / section.json_name
    if not path.exists():
        out += [f"Not run yet (no `{link_prefix}{section.json_name}`).", ""]
        return "\n".join(out)
    try:
        data = json.loads(path.read_text())
        out += [section.render(data).rstrip(), ""]
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise SparkTrainError(
            f"{path} does not have the shape the {section.key!r} table expects ({exc!r}); "
            f"rerun its benchmark: {section.command.splitlines()[0]}"
        ) from exc
    for image in section.images:
        if (results / image).exists():
            out += [f"![{section.title}]({link_prefix}{image})", ""]
    after = _read(str(notes / f"{section.key}.after.md")).strip()
    if after:
        out += [after, ""]
    return "\n".join(out)


def render(results: Path, link_prefix: str, info: dict[str, Any], today: str) -> str:
    """The whole results section (without the markers)."""
    intro = _read(str(results / "notes" / "intro.md")).strip()
    parts = ["## Results", "", machine_block(info, today), ""]
    if intro:
        parts += [intro, ""]
    parts += [render_section(s, results, link_prefix) for s in SECTIONS]
    return "\n".join(parts).rstrip() + "\n"


def _strip_machine(text: str) -> str:
    return re.sub(
        re.escape(MACHINE_BEGIN) + r".*?" + re.escape(MACHINE_END), "", text, flags=re.S
    ).strip()


def splice(readme: str, section: str) -> str:
    """``readme`` (the page) with the text between the markers replaced by ``section``."""
    start, end = readme.find(BEGIN), readme.find(END)
    if start < 0 or end < start:
        raise SparkTrainError(
            f"the results page has no {BEGIN} ... {END} pair: put the markers around the "
            "results section once, then rerun"
        )
    return readme[: start + len(BEGIN)] + "\n" + section + readme[end:]


def current_section(readme: str) -> str:
    start, end = readme.find(BEGIN), readme.find(END)
    if start < 0 or end < start:
        raise SparkTrainError(f"the results page has no {BEGIN} ... {END} pair")
    return readme[start + len(BEGIN) : end]


# ---------------------------------------------------------------------- entry
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--results", default="docs/results", help="folder of the JSON and PNGs")
    parser.add_argument(
        "--page",
        "--readme",  # deprecated alias: the section lived in README.md until the docs split
        dest="page",
        default=DEFAULT_PAGE,
        help=f"the markdown page holding the results markers (default {DEFAULT_PAGE})",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    mode.add_argument("--print", action="store_true", help="print the section, write nothing")


def main(args: argparse.Namespace) -> int:
    results, readme_path = Path(args.results), Path(args.page)
    if not readme_path.exists():
        raise SparkTrainError(f"{readme_path} not found; run from the repository root")
    # image links relative to the page
    rel = os.path.relpath(results.resolve(), readme_path.resolve().parent)
    prefix = "" if rel == "." else rel.replace(os.sep, "/") + "/"
    today = dt.datetime.now(dt.UTC).date().isoformat()
    section = render(results, prefix, machine(), today)
    readme = readme_path.read_text()
    if args.print:
        sys.stdout.write(section)
        return 0
    if args.check:
        stale = _strip_machine(current_section(readme)) != _strip_machine(section)
        print(f"{readme_path}: results section is {'STALE' if stale else 'up to date'}")
        if stale:
            print("regenerate it with: sparktrain bench report", file=sys.stderr)
        return 1 if stale else 0
    readme_path.write_text(splice(readme, section))
    print(f"{readme_path}: results section regenerated from {results}")
    return 0
