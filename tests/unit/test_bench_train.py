"""The head-to-head bench's bookkeeping (time to target, derived ratios, table, plot), the
README results generator, and tree_aggregate's sizing round — all without Spark."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from benchmarks import report as rep
from benchmarks import train as bt
from sparktrain import TrainConfig
from sparktrain.data.partition_data import PartitionData
from sparktrain.errors import SparkTrainError
from sparktrain.models import mlp
from sparktrain.result import state_to_bytes
from sparktrain.strategies.tree_aggregate.codec import NUM_STATS
from sparktrain.strategies.tree_aggregate.flat import flatten
from sparktrain.strategies.tree_aggregate.task import Block, RoundSpec, partition_round


# ------------------------------------------------------------------ bench train
def test_first_reaching_and_strategy_names():
    curve = [(1.0, 0.90), (2.0, 0.95), (3.0, 0.97)]
    assert bt.first_reaching(curve, 0.95) == 2.0
    assert bt.first_reaching(curve, 0.99) is None
    assert bt.first_reaching(curve, None) is None
    assert bt.strategy_config("ps-async") == {"strategy": "ps", "ps_mode": "async"}
    assert bt.strategy_config("tree_aggregate")["local_steps"] == bt.TREE_AGGREGATE_LOCAL_STEPS
    assert bt.strategy_config("ring-torch") == {"strategy": "ring", "comm_backend": "torch"}
    with pytest.raises(SparkTrainError, match="unknown contender 'rnig'"):
        bt.strategy_config("rnig")


def test_epoch_clock_timestamps_complete_lines_only(tmp_path: Path):
    path = tmp_path / "epochs.jsonl"
    clock = bt.EpochClock(path)
    clock.start()
    with path.open("w") as fh:
        fh.write(json.dumps({"type": "epoch", "metric": 0.5}) + "\n")
        fh.write('{"type": "epoch", "met')  # half a line: not read yet
        fh.flush()
        time.sleep(bt.POLL_S * 5)
        fh.write('ric": 0.96, "elapsed_s": 7.5}\n')
    clock.stop()
    curve = clock.curve()
    assert [m for _, m in curve] == [0.5, 0.96]
    assert curve[1][0] == 7.5  # a record's own elapsed_s wins over the arrival time
    assert 0 <= curve[0][0] < 5


def _run(**kw: Any) -> dict[str, Any]:
    base = {
        "contender": "sparktrain", "strategy": "ring", "compression": "none", "link": "none",
        "workload": "digits", "seed": 0, "repeat": 0, "whole_process_s": None,
        "time_to_target_s": 2.0, "final_accuracy": 0.96, "train_s": 10.0, "comm_s": 8.0,
        "samples_per_s": 1000.0, "wire_bytes": 1e6, "raw_bytes": 1e6, "compression_ratio": 1.0,
        "epochs": 10, "curve": [],
    }  # fmt: skip
    return {**base, **kw}


def _runs() -> list[dict[str, Any]]:
    return [
        _run(contender="ring", whole_process_s=20.0, whole_process_to_target_s=12.0),
        _run(contender="ring", whole_process_s=22.0, whole_process_to_target_s=14.0, repeat=1),
        _run(
            contender="torchdistributor",
            strategy="ddp-gloo",
            whole_process_s=40.0,
            whole_process_to_target_s=30.0,
            eval_s=0.01,
        ),
        _run(contender="sparktrain-fast", strategy="tree_aggregate", system="ours"),
        _run(contender="mllib", strategy="mlp-lbfgs", system="MLlib", time_to_target_s=2.5),
        # under 5g: fp16 halves the bytes and saves 45 % of a bandwidth-bound run
        # (250 MB over two links at 12.5 MB/s: 10 s, all of the training time)
        _run(link="5g", train_s=10.0, comm_s=8.0, wire_bytes=250e6),
        _run(link="5g", compression="fp16", train_s=5.5, compression_ratio=2.0),
        _run(
            link="5g",
            strategy="auto",
            compression="auto",
            time_to_target_s=2.1,
            chosen={"strategy": "ring", "compression": "fp16"},
        ),
        _run(link="5g", compression="int8+ef", error="boom"),
    ]


def test_derive_checks_every_target():
    d = bt.derive(_runs(), 0.95)
    head = d["ring_vs_torchdistributor"]
    assert head["ring_whole_process_to_target_s"] == 13.0  # median of two repeats
    assert head["ratio"] == pytest.approx(13.0 / 30.0) and head["met"]
    assert d["tree_aggregate_vs_mllib"]["ratio"] == pytest.approx(0.8)
    (row,) = d["compression_vs_ideal"]
    assert row["compression"] == "fp16" and row["comm_dominates"]
    assert row["transfer_share_none"] == pytest.approx(1.0)
    assert row["saving"] == pytest.approx(0.45) and row["ideal_saving"] == pytest.approx(0.5)
    assert row["fraction_of_ideal"] == pytest.approx(0.9) and row["met"]
    (auto,) = d["auto_vs_best"]
    assert auto["link"] == "5g" and auto["best_fixed"] == ["ring", "none"]
    assert auto["gap"] == pytest.approx(0.05) and auto["met"]


def test_the_session_floor_and_the_part_after_it():
    runs = [
        _run(contender="ring", whole_process_to_target_s=13.0, session_ready_s=6.0),
        _run(contender="torchdistributor", whole_process_to_target_s=12.0, session_ready_s=6.5),
        _run(contender="session", strategy="none", whole_process_s=6.6, session_ready_s=6.1),
    ]
    head = bt.derive(runs, 0.95)["ring_vs_torchdistributor"]
    assert head["floor_ratio"] == pytest.approx(6.6 / 12.0)  # above 0.5: no trainer meets it
    assert head["ring_after_session_s"] == pytest.approx(7.0)
    assert head["after_session_ratio"] == pytest.approx(7.0 / 5.5)
    assert "the floor under that target" in rep._train(
        {"target": 0.95, "runs": runs, "derived": {"ring_vs_torchdistributor": head}}
    )


def test_memory_steady_state_and_warm_targets():
    runs = [
        _run(contender="ring", whole_process_to_target_s=13.0, peak_pss_bytes=900e6,
             peak_rss_bytes=1500e6, warm_time_to_target_s=1.0, load_avg_1m=2.0),
        _run(contender="ring", whole_process_to_target_s=15.0, peak_pss_bytes=1100e6,
             peak_rss_bytes=1700e6, warm_time_to_target_s=1.2, repeat=1, load_avg_1m=3.5),
        _run(contender="torchdistributor", whole_process_to_target_s=12.0, peak_pss_bytes=1250e6,
             peak_rss_bytes=1300e6, warm_time_to_target_s=6.0, load_avg_1m=2.5),
        _run(contender="session", strategy="none", whole_process_s=6.6, peak_pss_bytes=200e6),
        # the steady part's synthetic runs are not the headline's digits children
        _run(contender="ring", workload="synthetic", part="steady", samples_per_s=12_000.0,
             whole_process_to_target_s=None),
        _run(contender="ring", workload="synthetic", part="steady", samples_per_s=14_000.0),
        _run(contender="torchdistributor", workload="synthetic", part="steady",
             samples_per_s=10_000.0),
        _run(contender="torchdistributor", workload="synthetic", part="steady",
             samples_per_s=11_000.0, error="boom"),
        _run(contender="compute-only", strategy="none", workload="synthetic", part="steady",
             samples_per_s=15_000.0),
    ]  # fmt: skip
    d = bt.derive(runs, 0.95)
    head = d["ring_vs_torchdistributor"]
    assert head["ring_whole_process_to_target_s"] == 14.0 and head["target"] == "<= 1.0"
    assert not head["met"] and head["load_avg_1m"] == [2.0, 3.5]
    warm = d["ring_vs_torchdistributor_warm"]
    assert warm["ratio"] == pytest.approx(1.1 / 6.0) and warm["met"]
    memory = d["memory_vs_torchdistributor"]
    assert memory["ratio"] == pytest.approx(0.8) and memory["met"]
    assert memory["rss_ratio"] == pytest.approx(1600 / 1300)
    assert memory["session_only_peak_pss_bytes"] == 200e6
    steady = d["steady_vs_ddp"]
    assert steady["ratio"] == pytest.approx(1.3) and steady["met"] and steady["runs"] == 1
    assert steady["compute_only_ratio"] == pytest.approx(1.5)
    section = rep._train({"target": 0.95, "runs": runs, "derived": d})
    assert "1000 MB / 1250 MB = 0.80 (target <= 1.0: met)" in section
    assert "13,000 / 10,000 = 1.30 (target >= 1.2: met); the compute floor" in section
    assert "15,000 = 1.50 x DDP" in section
    assert "(target <= 0.25: met)" in section and "load average 2.0-3.5" in section


def test_steady_rate_leaves_the_first_epoch_out():
    assert bt.steady_rate([4.0, 1.0, 2.0, 1.0], 1000) == pytest.approx(1000.0)
    assert bt.steady_rate([4.0], 1000) is None
    assert bt.steady_rate([4.0, 1.0], None) is None


def test_merge_replaces_only_the_cells_measured_again():
    old = {
        "args": {"parts": ["headline", "matrix"]},
        "bench_s": 100.0,
        "runs": [_run(contender="ring", repeat=0), _run(link="5g", compression="fp16")],
        "headline_rerun": {"stale": True},
    }
    new = {"args": {"parts": ["headline"]}, "bench_s": 10.0, "runs": [_run(contender="ring")]}
    merged = bt.merge_reports(old, new)
    assert [(r["contender"], r["link"]) for r in merged["runs"]] == [
        ("sparktrain", "5g"),
        ("ring", "none"),
    ]
    assert "measured" in merged["runs"][1] and "measured" not in merged["runs"][0]
    assert merged["args"] == old["args"] and merged["bench_s"] == 110.0
    assert merged["merged"][0]["args"] == new["args"] and "headline_rerun" not in merged


def test_compression_is_not_judged_where_compute_dominates():
    runs = [
        _run(link="5g", train_s=10.0, comm_s=9.0, wire_bytes=1e6),  # latency, not bytes
        _run(link="5g", compression="fp16", train_s=9.9, compression_ratio=2.0),
    ]
    (row,) = bt.derive(runs, 0.95)["compression_vs_ideal"]
    assert not row["comm_dominates"] and row["met"] is None


def test_table_and_plot(tmp_path: Path):
    report = {"target": 0.95, "runs": _runs()}
    report["derived"] = bt.derive(report["runs"], 0.95)
    text = bt.table(report)
    assert "| digits | none | ring | ring | none | 2.00 s | 21.0 s (13.0 s) | 0.9600 |" in text
    assert "| digits | 5g | sparktrain | ring | int8+ef | error |" in text
    bt.plot(report, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000
    section = rep._train({**report, "derived": report["derived"]})
    assert "ring / TorchDistributor" in section and "(target <= 1.0: met)" in section
    assert "| digits | ring | `fp16` |" in section


def test_arguments_defaults_cover_the_issue_matrix():
    parser = argparse.ArgumentParser()
    bt.add_arguments(parser)
    args = parser.parse_args([])
    assert args.strategies == ["ring", "tree", "ps-sync", "ps-async", "tree_aggregate"]
    assert args.compressions == ["none", "fp16", "int8+ef", "topk:0.01+ef"]
    assert args.workloads == ["digits", "synthetic"] and args.links == ["none", "5g"]


# ------------------------------------------------------------------ bench report
def _page(tmp_path: Path) -> Path:
    page = tmp_path / "docs" / "results.md"
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(f"# x\n\nintro\n\n{rep.BEGIN}\n## Results\nold\n{rep.END}\n\n## Layout\n")
    return page


def _args(page: Path, results: Path, **kw: bool) -> argparse.Namespace:
    return argparse.Namespace(
        page=str(page), results=str(results), check=kw.get("check", False), print=False
    )


def test_report_regenerates_between_the_markers_and_checks(tmp_path: Path, capsys):
    results = tmp_path / "docs" / "results"
    (results / "notes").mkdir(parents=True)
    (results / "digits_ring.json").write_text(
        json.dumps(
            {
                "strategy": "ring",
                "metric_value": 0.9756,
                "wall_s": 12.3,
                "train_s": 0.53,
                "bytes_sent": 33.8e6,
                "wire_bytes": 34.0e6,
            }
        )
    )
    (results / "notes" / "digits.after.md").write_text("Most of the wall time is Spark.\n")
    readme = _page(tmp_path)
    assert rep.main(_args(readme, results, check=True)) == 1  # "old" is stale
    assert rep.main(_args(readme, results)) == 0
    text = readme.read_text()
    assert text.startswith("# x\n\nintro\n") and text.endswith(f"{rep.END}\n\n## Layout\n")
    assert "| ring | 0.9756 | 12.3 s | 0.53 s | 33.8 MB | 34.0 MB |" in text
    assert "Most of the wall time is Spark." in text
    assert "Not run yet (no `results/allreduce.json`)" in text  # relative to docs/results.md
    assert "Generated by `sparktrain bench report` on" in text and "RAM" in text
    assert rep.main(_args(readme, results, check=True)) == 0
    # another day, another machine: still up to date
    other = re.sub(r"on \d{4}-\d{2}-\d{2} on \d+ ×", "on 1999-01-01 on 64 ×", text)
    assert other != text
    readme.write_text(other)
    assert rep.main(_args(readme, results, check=True)) == 0
    assert "up to date" in capsys.readouterr().out


def test_report_refuses_a_page_without_markers_and_bad_json(tmp_path: Path):
    readme = tmp_path / "README.md"
    readme.write_text("# x\n## Results\n")
    with pytest.raises(SparkTrainError, match="no <!-- results:begin -->"):
        rep.main(_args(readme, tmp_path))
    readme = _page(tmp_path)
    (tmp_path / "digits_ring.json").write_text("{}")
    with pytest.raises(SparkTrainError, match="rerun its benchmark"):
        rep.main(_args(readme, tmp_path))


def test_generic_table_flattens_rows():
    text = rep.generic_table([{"a": 1, "b": 0.123456, "c": {"nested": 1}}, {"a": 2, "d": True}])
    assert text.splitlines()[0] == "| a | b | d |"
    assert "| 1 | 0.1235 | - |" in text and "| 2 | - | true |" in text


def test_report_targets_docs_results_and_keeps_readme_as_an_alias():
    parser = argparse.ArgumentParser()
    rep.add_arguments(parser)
    assert parser.parse_args([]).page == "docs/results.md"
    assert parser.parse_args(["--readme", "x.md"]).page == "x.md"
    assert parser.parse_args(["--page", "y.md", "--check"]).page == "y.md"


def test_the_repository_results_page_is_generated_from_its_results():
    root = Path(__file__).resolve().parents[2]
    page = (root / "docs" / "results.md").read_text()
    assert rep.BEGIN in page and rep.END in page
    readme = (root / "README.md").read_text()
    assert rep.BEGIN not in readme  # the README is a front page; the figures live in docs/


def test_the_readme_is_a_front_page_and_every_link_stays_in_the_repository():
    root = Path(__file__).resolve().parents[2]
    assert (root / "README.md").stat().st_size <= 12 * 1024
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if target.startswith("#"):
                continue
            assert "://" not in target and not target.startswith("/"), (page.name, target)
            path = (page.parent / target.split("#")[0]).resolve()
            assert path.is_relative_to(root) and path.exists(), (page.name, target)


# ------------------------------------------------------------------ the sizing round
def test_sizing_round_reports_row_counts_and_trains_round_zero():
    torch.manual_seed(0)
    model = mlp(4, (3,), 2)
    rng = np.random.default_rng(0)

    def data(n: int, val: bool) -> PartitionData:
        x = rng.standard_normal((n, 4)).astype(np.float32)
        return PartitionData(x, (x[:, 0] > 0).astype(np.float64), np.full(n, val))

    blocks = [
        Block(0, data(30, False), data(5, True)),
        Block(1, data(12, False), data(7, True)),
    ]
    cfg = TrainConfig(
        strategy="tree_aggregate", batch_size=8, lr=0.1, optimizer="sgd", progress=False
    )
    sized = RoundSpec("sizing", cfg, state_to_bytes(model.state_dict()), 0, False, size_slots=2,
                      model_fn=functools.partial(mlp, 4, (3,), 2))  # fmt: skip
    weights = flatten(list(model.parameters()))
    parts = [partition_round(sized, weights, b, 0) for b in blocks]
    stats = parts[0][1] + parts[1][1]
    assert stats.shape == (NUM_STATS + 4,)
    assert list(stats[NUM_STATS:]) == [30, 12, 5, 7]
    # the same contribution as round 0 of a spec that knew rounds_per_epoch
    known = dataclasses.replace(sized, job_id="known", rounds_per_epoch=4, size_slots=0)
    again = [partition_round(known, weights, b, 0) for b in blocks]
    for (p, _), (q, s) in zip(parts, again, strict=True):
        np.testing.assert_array_equal(p, q)
        assert s.shape == (NUM_STATS,)


def test_a_ddp_epoch_takes_its_steps_even_on_a_short_shard() -> None:
    import torch

    from benchmarks.train import ddp_epoch

    model = torch.nn.Linear(3, 2)
    stepped: list[int] = []
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.register_step_post_hook(lambda *_: stepped.append(1))
    x, y = torch.randn(5, 3), torch.tensor([0, 1, 0, 1, 0])
    before = model.weight.detach().clone()
    ddp_epoch(model, opt, x, y, batch=2, steps=4, seed=0)  # 3 batches of rows, then a repeat
    assert len(stepped) == 4
    assert not torch.equal(before, model.weight)


# ------------------------------------------------------------------ steady part: worlds, bf16
def _steady(contender: str, world: int | None, rate: float, **kw: Any) -> dict[str, Any]:
    stem = contender.removesuffix("-bf16")
    extra = {} if world is None else {"world": world}
    if world is not None:
        extra["precision"] = "bf16" if contender.endswith("-bf16") else "fp32"
    return _run(
        contender=contender,
        strategy=dict(bt.STEADY_KINDS)[stem],
        workload="synthetic",
        part="steady",
        samples_per_s=rate,
        final_accuracy=0.5,
        **extra,
        **kw,
    )


def test_steady_order_rotates_every_contender_of_every_precision():
    first = bt.steady_order(["fp32", "bf16"], 0)
    assert first[:3] == [("ring", "fp32"), ("torchdistributor", "fp32"), ("compute-only", "fp32")]
    assert len(first) == 6 and len(set(first)) == 6
    assert bt.steady_order(["fp32", "bf16"], 1) == first[1:] + first[:1]
    firsts = {bt.steady_order(["fp32", "bf16"], r)[0] for r in range(6)}
    assert firsts == set(first)  # each contender goes first once in six repeats
    assert bt.steady_name("ring", "fp32") == "ring"
    assert bt.steady_name("compute-only", "bf16") == "compute-only-bf16"


def test_steady_rows_per_world_and_precision():
    runs = [
        # an older record without world/precision counts as world 2, fp32
        _steady("ring", None, 10_000.0),
        _steady("torchdistributor", 2, 10_000.0),
        _steady("compute-only", 2, 12_500.0),
        _steady("ring-bf16", 2, 24_000.0),
        _steady("torchdistributor-bf16", 2, 20_000.0),
        _steady("compute-only-bf16", 2, 30_000.0),
        _steady("ring", 4, 9_000.0, load_avg_1m=1.5),
        _steady("torchdistributor", 4, 6_000.0, load_avg_1m=2.5),
        _steady("torchdistributor", 4, 99.0, error="boom"),
        _steady("compute-only", 4, 12_000.0),
    ]
    d = bt.derive(runs, 0.95)
    # the issue's headline figure stays world 2, fp32: world 4's runs are not mixed in
    assert d["steady_vs_ddp"]["ratio"] == pytest.approx(1.0)
    rows = {(r["world"], r["precision"]): r for r in d["steady"]}
    assert set(rows) == {(2, "fp32"), (2, "bf16"), (4, "fp32")}
    bf16 = rows[(2, "bf16")]
    assert bf16["ratio"] == pytest.approx(1.2) and bf16["met"]
    assert bf16["ratio_vs_ddp_fp32"] == pytest.approx(2.4)
    assert bf16["ring_of_floor"] == pytest.approx(0.8)
    w4 = rows[(4, "fp32")]
    assert w4["ratio"] == pytest.approx(1.5) and w4["runs"] == 1 and w4["load_avg_1m"] == [1.5, 2.5]
    assert not rows[(2, "fp32")]["met"]
    text = bt.steady_table({"runs": runs})
    assert "| 2 | bf16 | ring-bf16 | 24,000 | 24,000-24,000 | 1.20 | 0.80 | 0.5000 | 1 |" in text
    assert "| 4 | fp32 | torchdistributor | 6,000 |" in text
    assert "world 2, bf16: ring / DDP 24,000 / 20,000 = 1.20 (target >= 1.2: met); " in text
    assert "against DDP in fp32 2.40" in text
    assert text.index("| 2 | fp32 | ring |") < text.index("| 2 | bf16 |") < text.index("| 4 |")
    assert rep._steady({"runs": runs}) == text


def test_merge_keeps_other_worlds_apart():
    old = {
        "args": {},
        "bench_s": 1.0,
        "runs": [_steady("ring", None, 1.0), _steady("ring", 4, 2.0)],
    }
    new = {"args": {}, "bench_s": 1.0, "runs": [_steady("ring", 2, 3.0)]}
    merged = bt.merge_reports(old, new)
    assert sorted(r["samples_per_s"] for r in merged["runs"]) == [2.0, 3.0]


def test_steady_arguments_and_the_bf16_ddp_step():
    parser = argparse.ArgumentParser()
    bt.add_arguments(parser)
    args = parser.parse_args([])
    assert args.steady_worlds == [2] and args.steady_precisions == ["fp32"]
    args = parser.parse_args(["--steady-worlds", "2", "4", "--steady-precisions", "fp32", "bf16"])
    assert args.steady_worlds == [2, 4] and args.steady_precisions == ["fp32", "bf16"]
    with pytest.raises(SparkTrainError, match="unknown precision"):
        bt.autocast("fp8")
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 3), torch.tensor([0, 1] * 4)
    bt.ddp_epoch(model, opt, x, y, batch=4, steps=2, seed=0, precision="bf16")
    assert model.weight.dtype == torch.float32  # float32 master weights under autocast
    with bt.autocast("bf16"):
        assert model(x).dtype == torch.bfloat16
