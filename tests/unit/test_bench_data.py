"""The data-path bench without Spark: arguments, sizes, the growth/ratio/wait-share
figures, the JSON shape, the table and plot, the Parquet shards and the peer's loop."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import data as bd
from sparktrain.errors import ConfigError


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bd.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_defaults_validate_and_span_a_quarter_to_four_budgets():
    args = parse()
    bd.validate(args)
    assert args.budget_mb == 64 and args.world == 2 and args.prefetch == 2
    assert args.factors == [0.25, 1.0, 2.0, 4.0] and args.throughput_factor == 2.0
    assert args.in_ram_mb > max(args.factors) * args.budget_mb
    # 64 MiB of 64 float32 per row: 262144 rows per worker at 1x
    assert bd.rows_per_worker(64, 1.0) == 262_144
    assert bd.rows_per_worker(64, 0.25) == 65_536


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--world", "1"], "--world"),
        (["--repeats", "0"], "--repeats"),
        (["--budget-mb", "0"], "--budget-mb"),
        (["--factors", "0.25", "0.6"], "whole multiple"),
        (["--throughput-factor", "3"], "one of --factors"),
        (["--throughput-factor", "1"], "nothing spills"),
        (["--in-ram-mb", "200"], "--in-ram-mb"),
        (["--prefetch", "0"], "--prefetch"),
    ],
)
def test_arguments_the_bench_cannot_measure_with_are_refused(argv, message):
    with pytest.raises(ConfigError, match=message):
        bd.validate(parse(*argv))


def test_every_size_reads_a_prefix_of_the_same_shards():
    unit, plan = bd.shard_plan([1.0, 0.25, 4.0, 0.5], world=2)
    assert unit == 0.25
    assert plan == {0.25: 2, 0.5: 4, 1.0: 8, 4.0: 32}


def rec(part: str, mode: str, factor: float, peaks: list[int] | None, **extra: Any) -> dict:
    rows = bd.rows_per_worker(64, factor)
    return {
        "part": part,
        "mode": mode,
        "factor": factor,
        "rows_per_worker": rows,
        "partition_bytes": rows * bd.ROW_BYTES,
        "peak_anon_bytes_per_worker": peaks,
        "prefetch_batches": 0 if mode == bd.NO_PREFETCH else 2,
        "samples_per_s": extra.pop("sps", 1000.0),
        "train_s": extra.pop("train_s", 10.0),
        "data_wait_s": extra.pop("wait", None),
        "data_path": extra.pop("path", None),
        "data_spilled_bytes": extra.pop("spilled", None),
        "final_loss": extra.pop("loss", factor + (mode == bd.IN_RAM)),
        **extra,
    }


MIB = bd.MIB


def records() -> list[dict]:
    out = []
    for f, spilled, in_ram in ((0.25, 300, 310), (1.0, 320, 370), (4.0, 330, 560)):
        out.append(rec("memory", bd.SPILLED, f, [spilled * MIB, (spilled - 5) * MIB]))
        out.append(rec("memory", bd.IN_RAM, f, [in_ram * MIB, in_ram * MIB]))
    for sps_s, sps_r, sps_n in ((900, 1000, 800), (950, 1000, 700), (990, 1100, 750)):
        out.append(rec("throughput", bd.SPILLED, 1.0, [320 * MIB] * 2, sps=sps_s, wait=0.2))
        out.append(rec("throughput", bd.IN_RAM, 1.0, [370 * MIB] * 2, sps=sps_r, wait=0.1))
        out.append(rec("throughput", bd.NO_PREFETCH, 1.0, [320 * MIB] * 2, sps=sps_n, wait=2.0))
    return out


def test_growth_is_the_largest_ranks_peak_over_the_smallest_size():
    rows = bd.growth(records(), bd.SPILLED)
    assert [r["factor"] for r in rows] == [0.25, 1.0, 4.0]
    assert rows[0]["growth"] == 0.0
    assert rows[-1]["growth"] == pytest.approx(330 / 300 - 1)
    ram = bd.growth(records(), bd.IN_RAM)
    assert ram[-1]["growth"] == pytest.approx(560 / 310 - 1)
    # 250 MiB more anon memory over 60 MiB more partition... per byte of partition
    span = (bd.rows_per_worker(64, 4.0) - bd.rows_per_worker(64, 0.25)) * bd.ROW_BYTES
    assert bd.slope(ram) == pytest.approx(250 * MIB / span)


def test_missing_peaks_give_no_growth_rather_than_a_wrong_one():
    rows = bd.growth([rec("memory", bd.SPILLED, 1.0, None)], bd.SPILLED)
    assert rows[0]["peak_anon_bytes"] is None and rows[0]["growth"] is None
    assert bd.slope(rows) is None
    d = bd.derive([rec("memory", bd.SPILLED, 1.0, None)], None, 1.0)
    assert d["memory"]["met"] is None and d["throughput"]["ratio"] is None


def test_derive_gives_medians_the_ratio_and_the_wait_shares():
    peer = {"kind": "pyarrow.dataset", "samples_per_s": 1900.0, "peak_anon_bytes": 400 * MIB}
    d = bd.derive(records(), peer, 1.0)
    mem = d["memory"]
    assert mem["spilled_growth"] == pytest.approx(0.1) and mem["met"] is True
    t = d["throughput"]
    assert t["median_samples_per_s"] == {
        bd.SPILLED: 950,
        bd.IN_RAM: 1000,
        bd.NO_PREFETCH: 750,
    }
    assert t["ratio"] == pytest.approx(0.95) and t["met"] is True
    p = d["prefetch"]
    assert p["prefetch_batches"] == [2]
    assert p["median_wait_share"] == {bd.SPILLED: 0.02, bd.NO_PREFETCH: 0.2}
    assert d["peer"]["ratio"] == pytest.approx(950 / 1900)
    assert d["peer"]["sparktrain_spilled_peak_anon_bytes_per_worker"] == 320 * MIB


def test_the_json_round_trips_and_the_page_renders_it(tmp_path: Path):
    args = parse("--factors", "0.25", "1", "4", "--throughput-factor", "4")
    peer = {
        "kind": "pyarrow.dataset",
        "samples_per_s": 1900.0,
        "peak_anon_bytes": 400 * MIB,
        "data_anon_bytes": 90 * MIB,
        "threads": 2,
        "petastorm": "not usable here (ModuleNotFoundError: No module named 'petastorm')",
    }
    data = json.loads(json.dumps(bd.build_result(args, records(), peer, 12.5)))
    assert set(data) == {"setup", "records", "peer", "derived"}
    assert set(data["derived"]) == {"memory", "throughput", "prefetch", "peer", "checks"}
    assert data["derived"]["checks"]["same_loss_per_size"] is False  # in RAM differs here
    assert data["setup"]["budget_mb"] == 64 and data["setup"]["factors"] == [0.25, 1, 4]
    text = bd.table(data)
    assert text.splitlines()[0].startswith("| partition / budget |")
    assert "| 4x | 1,048,576 | 256.0 MiB | 330.0 MiB | +10% |" in text
    assert "target <= +25%: met" in text
    assert "- Petastorm: not usable here" in text
    bd.plot(data, tmp_path / "data.png")
    assert (tmp_path / "data.png").stat().st_size > 1000


def test_the_report_page_has_a_section_for_the_bench():
    from benchmarks import report

    section = next(s for s in report.SECTIONS if s.key == "bench_data")
    assert section.json_name == "bench_data.json" and "bench data" in section.command


def test_wait_share_needs_both_figures():
    assert bd.wait_share({"data_wait_s": 1.0, "train_s": 4.0}) == 0.25
    assert bd.wait_share({"data_wait_s": None, "train_s": 4.0}) is None
    assert bd.wait_share({"data_wait_s": 1.0, "train_s": 0.0}) is None


def test_shards_are_equal_and_the_peer_trains_on_them(tmp_path: Path):
    import pyarrow.parquet as pq
    import torch

    paths = bd.write_shards(tmp_path, shards=3, rows=700)
    sizes = {p.stat().st_size for p in paths}
    assert len(sizes) == 1  # Spark then packs them evenly
    table = pq.read_table(paths[1])
    assert table.column_names == ["id", "features", "label"]
    assert table.column("id").to_pylist()[0] == 700
    assert table.num_rows == 700 and len(table.column("features")[0]) == bd.WIDTH
    labels = set(table.column("label").to_pylist())
    assert labels <= set(range(bd.CLASSES)) and len(labels) > 1
    threads = torch.get_num_threads()
    out = bd.peer_loop(paths, epochs=2, batch=256, lr=0.05, hidden=[16], threads=threads)
    assert out["samples"] == 2 * 3 * 700 and out["samples_per_s"] > 0
    assert out["peak_anon_bytes"] >= out["baseline_anon_bytes"] > 0


def test_leftover_local_files_are_those_under_a_spill_folder(tmp_path: Path):
    (tmp_path / "blockmgr-1" / "0a").mkdir(parents=True)
    (tmp_path / "blockmgr-1" / "0a" / "shuffle_0.data").write_text("x")
    job = tmp_path / "blockmgr-1" / "sparktrain-spill" / "job1"
    job.mkdir(parents=True)
    (job / "rank0-attempt0-pid1.arrow").write_text("x")
    assert bd.leftover_local_files(tmp_path) == [
        "blockmgr-1/sparktrain-spill/job1/rank0-attempt0-pid1.arrow"
    ]
    assert bd.leftover_local_files(tmp_path / "missing") == []


def test_checks_say_whether_every_run_of_a_size_ended_alike():
    same = [
        rec("memory", m, f, [1], loss=f, leftover_local_files=0, input_partitions=2)
        for f in (1.0, 2.0)
        for m in (bd.SPILLED, bd.IN_RAM)
    ]
    checks = bd.derive(same, None, 2.0)["checks"]
    assert checks == {
        "same_loss_per_size": True,
        "leftover_spill_files": 0,
        "input_partitions": [2],
    }
    same[0]["leftover_local_files"] = 1
    assert bd.derive(same, None, 2.0)["checks"]["leftover_spill_files"] == 1
