"""The multi-host bench and cluster without root or Spark: arguments, the interleaved
order, medians and the emulated/tbf verdict, the table and the results page's section,
and the reason given where namespaces cannot be made."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import pytest

from benchmarks import multihost
from benchmarks import report as rp
from benchmarks.cli import build_parser
from sparktrain.errors import SparkTrainError
from tests.cluster import netcluster


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    multihost.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_defaults_cover_every_contender_and_both_workloads():
    args = parse()
    multihost._check(args)
    assert args.contenders == ["ring", "tree", "ps", "tree_aggregate", "ddp"]
    assert args.workloads == ["digits", "synthetic"]
    assert args.rate_mbit == 100.0 and args.compare_contenders == ["ring", "ps", "ps1"]


def test_the_cli_knows_the_bench():
    args = build_parser(bench="multihost").parse_args(["multihost", "--repeats", "1"])
    assert args.what == "multihost" and args.repeats == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--contenders", "gloo"), "unknown contender 'gloo'"),
        (("--workloads", "mnist"), "unknown workload 'mnist'"),
        (("--compare-contenders", "ddp"), "sparktrain strategies only"),
        (("--rate-mbit", "0"), "--rate-mbit must be > 0"),
        (("--busbw-worlds", "2", "16"), "--busbw-worlds: each between 2 and 8"),
        (("--busbw-iterations", "0"), "--busbw-iterations must be >= 1"),
    ],
)
def test_arguments_the_bench_cannot_measure_with_are_refused(argv, message):
    with pytest.raises(SparkTrainError, match=message):
        multihost._check(parse(*argv))


def test_every_item_leads_in_turn():
    items = ["ring", "tree", "ps"]
    orders = [multihost.rotated(items, r) for r in range(3)]
    assert [o[0] for o in orders] == items
    assert all(Counter(o) == Counter(items) for o in orders)


def _rec(contender: str, step_s: float, mode: str = "", **extra: object) -> dict:
    return {"workload": "synthetic", "contender": contender, "mode": mode, "step_s": step_s,
            "samples_per_s": 1.0 / step_s, "accuracy": 0.5, "wire_bytes": 10, "veth_bytes": 12,
            "load_1m": 2.0, **extra}  # fmt: skip


def test_summaries_are_medians_and_count_errors():
    records = [_rec("ring", 1.0), _rec("ring", 3.0), _rec("ring", 2.0)]
    records.append({"workload": "synthetic", "contender": "ring", "error": "boom"})
    (row,) = multihost.summarize(records, ("workload", "contender"))
    assert row["step_s"] == 2.0 and row["runs"] == 3 and row["errors"] == 1


def test_the_verdict_is_emulated_over_tbf_within_15_percent():
    records = [
        _rec("ring", 0.50, "tbf"), _rec("ring", 0.52, "tbf"), _rec("ring", 0.48, "tbf"),
        _rec("ring", 0.55, "emulated"), _rec("ring", 0.56, "emulated"),
        _rec("ps", 1.0, "tbf"), _rec("ps", 1.2, "emulated"),
    ]  # fmt: skip
    verdicts = {v["contender"]: v for v in multihost.link_verdicts(records)}
    assert verdicts["ring"]["ratio"] == pytest.approx(0.555 / 0.50)
    assert verdicts["ring"]["within_15pct"] is True
    assert verdicts["ps"]["ratio"] == pytest.approx(1.2) and not verdicts["ps"]["within_15pct"]


def _busbw(algo: str, world: int, busbw: float, link: str = "tbf 100 Mbit/s") -> dict:
    return {"algo": algo, "world": world, "bytes": 1 << 20, "time_s": 0.1, "busbw": busbw,
            "link": link, "load_1m": 3.0}  # fmt: skip


def test_busbw_ratios_pair_ring_with_gloo_on_the_same_link_world_and_size():
    records = [
        _busbw("ring", 2, 0.012), _busbw("gloo", 2, 0.010),
        _busbw("ring", 2, 1.0, "veth, unshaped"), _busbw("gloo", 2, 2.0, "veth, unshaped"),
        _busbw("ring", 4, 0.011),
    ]  # fmt: skip
    out = {(r["link"], r["world"]): r for r in multihost.busbw_ratios(records)}
    assert out[("tbf 100 Mbit/s", 2)]["ring_over_gloo"] == pytest.approx(1.2)
    assert out[("veth, unshaped", 2)]["ring_over_gloo"] == pytest.approx(0.5)
    assert out[("tbf 100 Mbit/s", 4)]["ring_over_gloo"] is None  # no Gloo row to pair with


def _report() -> dict:
    records = [_rec("ring", 0.4), _rec("ddp", 0.5, wire_bytes=None)]
    compare = [_rec("ring", 0.5, "tbf"), _rec("ring", 0.55, "emulated")]
    return {
        "rate_mbit": 100.0,
        "repeats": 1,
        "summary": multihost.summarize(records, ("workload", "contender")),
        "link_compare": multihost.link_verdicts(compare),
        "busbw": [_busbw("ring", 4, 0.0112), _busbw("gloo", 4, 0.0100)],
    }


def test_the_json_round_trips_and_the_page_renders_it(tmp_path: Path):
    (tmp_path / "bench_multihost.json").write_text(json.dumps(_report()))
    section = next(s for s in rp.SECTIONS if s.key == "bench_multihost")
    text = rp.render_section(section, tmp_path, "")
    assert "| synthetic | ring | 400.0 ms | 2 | 0.5000 | 0.0 MB | 0.0 MB | 2.00 |" in text
    assert "| synthetic | ddp | 500.0 ms | 2 | 0.5000 | - |" in text
    assert "| synthetic | ring | 500.0 ms | 550.0 ms | 1.100 | yes | 2.00 |" in text
    assert "| tbf 100 Mbit/s | 4 | 1 MiB | 11.2 MB/s | 10.0 MB/s | 1.12 | 3.00 |" in text


def test_without_root_the_cluster_says_why(monkeypatch):
    monkeypatch.setattr(netcluster.os, "geteuid", lambda: 1000)
    assert "need root" in (netcluster.unavailable() or "")
    with pytest.raises(RuntimeError, match="need root"):
        netcluster.NetCluster(Path("unused")).__enter__()


def test_without_tc_the_cluster_says_what_to_install(monkeypatch):
    monkeypatch.setattr(netcluster.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netcluster, "_tool", lambda name: None if name == "tc" else "/bin/ip")
    assert netcluster.unavailable() == "`tc` not found (install iproute2)"


def test_a_cluster_size_the_subnet_cannot_hold_is_refused():
    with pytest.raises(ValueError, match="use 1..8"):
        netcluster.NetCluster(Path("unused"), workers=9)
