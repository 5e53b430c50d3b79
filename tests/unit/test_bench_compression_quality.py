"""``bench compression --quality`` (issue 21): batches, paired gaps, verdicts, tables, the
plot and the time-to-accuracy extraction, on synthetic records (no Spark)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import compression, compression_worlds, report
from benchmarks.compression_worlds import (
    Variant,
    ablation_variants,
    aggregate,
    per_worker_batch,
    steps_per_epoch,
    summarize_time_to,
    target_for,
    time_to_accuracy,
)
from sparktrain.config import TrainConfig
from sparktrain.errors import ConfigError


def _rec(spec: str, world: int, seed: int, acc: float, wire: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": "mlp",
        "strategy": "ring",
        "world": world,
        "spec": spec,
        "compression": extra.pop("compression", spec),
        "seed": seed,
        "accuracy": acc,
        "wire_bytes": wire,
        "compression_path": extra.pop("path", None),
        "load1": 2.5,
        **extra,
    }


def _grid() -> list[dict[str, Any]]:
    """none, int8+ef (0.5 pp target) and top-k (1 pp, 25x) at worlds 2 and 4, 3 seeds."""
    acc_none = {0: 0.97, 1: 0.96, 2: 0.98}
    recs = []
    for world in (2, 4):
        for seed in (0, 1, 2):
            base = acc_none[seed]
            recs.append(_rec("none", world, seed, base, 1_000_000))
            # int8: gaps 0.2, 0.4, 0.9 pp -> median 0.4, met at both worlds
            recs.append(_rec("int8+ef", world, seed, base - [0.002, 0.004, 0.009][seed], 250_000))
            # top-k: gaps 0.5 pp at world 2; 2.0 pp at world 4 (missed), 30x fewer bytes
            gap = 0.005 if world == 2 else 0.02
            recs.append(_rec("topk:0.01+ef", world, seed, base - gap, 33_000, path="reduce"))
    return recs


def test_per_worker_batch_divides_the_global_batch_or_says_what_to_do() -> None:
    assert [per_worker_batch(64, w) for w in (1, 2, 4, 8)] == [64, 32, 16, 8]
    with pytest.raises(ConfigError, match="does not divide by world 3"):
        per_worker_batch(64, 3)
    with pytest.raises(ConfigError, match=">= 1"):
        per_worker_batch(0, 2)


def test_steps_per_epoch_and_warmup_follow_drop_last() -> None:
    assert steps_per_epoch(1347, 64, drop_last=False) == 22
    assert steps_per_epoch(1347, 64, drop_last=True) == 21
    labels = [v.label for v in ablation_variants(5.0, 88)]
    assert labels == [
        "topk:0.01+ef:momentum=0.9,mask=0",
        "topk:0.01+ef:momentum=0.9,local_clip=5",
        "topk:0.01,warmup=88+ef:momentum=0.9",
        "topk:0.01+ef [allgather]",
    ]
    with pytest.raises(ConfigError, match="local-clip"):
        ablation_variants(0.0, 88)


def test_targets_cover_topk_dgc_variants_and_nothing_else() -> None:
    for spec in (
        "topk:0.01+ef",
        "topk:0.01+ef:momentum=0.9",
        "topk:0.01+ef:momentum=0.9,mask=0",
        "topk:0.01,warmup=88+ef:momentum=0.9",
    ):
        assert target_for(spec) == (1.0, 25.0), spec
    assert target_for("int8+ef") == (0.5, None)
    assert target_for("powersgd:2+ef") == (0.5, None)
    assert target_for("sign:chunk=32+ef:momentum=0.9") == (1.0, None)
    for spec in ("topk:0.01", "topk:0.1+ef", "none", "sign+ef"):
        assert target_for(spec) is None, spec


def test_paired_gaps_medians_reductions_and_verdicts() -> None:
    rows = {(r["spec"], r["world"]): r for r in aggregate(_grid())}
    int8 = rows[("int8+ef", 4)]
    assert int8["gap_pp"] == pytest.approx([0.2, 0.4, 0.9])
    assert (int8["gap_median"], int8["gap_min"], int8["gap_max"]) == pytest.approx((0.4, 0.2, 0.9))
    assert int8["reduction"] == pytest.approx(4.0)
    assert int8["meets_target"] and int8["target"] == "<= 0.5 pp"
    topk2, topk4 = rows[("topk:0.01+ef", 2)], rows[("topk:0.01+ef", 4)]
    assert topk2["gap_median"] == pytest.approx(0.5) and topk2["meets_target"]
    assert topk2["reduction"] == pytest.approx(1_000_000 / 33_000)
    assert topk2["compression_path"] == ["reduce"]
    assert topk4["gap_median"] == pytest.approx(2.0) and not topk4["meets_target"]
    assert "meets_target" not in rows[("none", 2)]


def test_gaps_pair_by_seed_and_bytes_miss_fails_the_verdict() -> None:
    recs = [
        _rec("none", 2, 0, 0.90, 1000),
        _rec("none", 2, 1, 0.99, 1000),
        # seed 1's run is 9 pp below seed 0's none, yet only 0 pp below its own
        _rec("topk:0.01+ef", 2, 1, 0.99, 100),
        _rec("topk:0.01+ef", 2, 2, 0.50, 100),  # no none of seed 2: left out, counted
    ]
    (row,) = [r for r in aggregate(recs) if r["spec"] != "none"]
    assert row["gap_pp"] == [pytest.approx(0.0)] and row["unpaired"] == 1
    assert row["reduction"] == pytest.approx(10.0)
    assert not row["meets_target"]  # 0 pp, but 10x < 25x


def test_forced_path_rows_take_their_spec_target() -> None:
    label = Variant("topk:0.01+ef", path="allgather").label
    recs = [
        _rec("none", 8, 0, 0.95, 10_000_000),
        _rec(label, 8, 0, 0.948, 200_000, compression="topk:0.01+ef", path="allgather"),
    ]
    row = next(r for r in aggregate(recs) if r["spec"] == label)
    assert label == "topk:0.01+ef [allgather]"
    assert row["meets_target"] and row["reduction"] == pytest.approx(50.0)
    assert row["compression_path"] == ["allgather"]


def test_tables_one_per_model_specs_by_world() -> None:
    text = compression_worlds.tables(aggregate(_grid()))
    assert text.startswith("**mlp**, ring, seeds 0, 1, 2")
    assert "| compression | target | world 2 | world 4 |" in text
    assert "| `none` | - | acc 97.00 % | acc 97.00 % |" in text
    assert "| `int8+ef` | <= 0.5 pp | +0.40 [+0.20, +0.90] / 4.0x / met |" in text
    assert "+2.00 [+2.00, +2.00] / 30.3x / MISSED |" in text


def _timed(spec: str, seed: int, metrics: list[float], load: float = 1.0) -> dict[str, Any]:
    history = [{"epoch": i, "metric": m, "seconds": 2.0} for i, m in enumerate(metrics)]
    return {**_rec(spec, 4, seed, metrics[-1], 1, link="5g", load1=load), "history": history}


def test_time_to_accuracy_sums_epoch_times_to_the_first_epoch_reaching_it() -> None:
    history = [
        {"epoch": 0, "metric": 0.80, "seconds": 3.0},
        {"epoch": 1, "metric": 0.951, "seconds": 2.5},
        {"epoch": 2, "metric": 0.94, "seconds": 2.0},
    ]
    assert time_to_accuracy(history, 0.95) == {"seconds": 5.5, "epoch": 1}
    assert time_to_accuracy(history, 0.80) == {"seconds": 3.0, "epoch": 0}
    assert time_to_accuracy(history, 0.96) is None
    rows = summarize_time_to(
        [
            _timed("none", 0, [0.5, 0.96]),
            _timed("topk:0.01+ef:momentum=0.9", 0, [0.96, 0.97]),
            _timed("none", 1, [0.5, 0.7, 0.96]),
            _timed("topk:0.01+ef:momentum=0.9", 1, [0.5, 0.6]),  # never reached
        ],
        0.95,
    )
    none, topk = rows
    assert (none["reached"], none["seconds_median"], none["vs_none"]) == (2, 5.0, 1.0)
    assert (topk["reached"], topk["seconds_median"], topk["epoch_median"]) == (1, 2.0, 0)
    assert topk["vs_none"] == pytest.approx(0.4)
    table = compression_worlds.time_to_table(rows, 0.95)
    assert "| mlp | 4 | 5g | `topk:0.01+ef:momentum=0.9` | 1/2 | 0 | 2.0 | 0.40x |" in table


def _data() -> dict[str, Any]:
    recs = _grid()
    timed = [_timed("none", 0, [0.5, 0.96], 3.2), _timed("topk:0.01+ef", 0, [0.96], 3.4)]
    return {
        "format": compression_worlds.FORMAT,
        "config": {"global_batch": 64, "epochs": 20, "drop_last": False, "seeds": [0, 1, 2]},
        "records": recs,
        "rows": aggregate(recs),
        "time_to": {"target": 0.95, "records": timed, "rows": summarize_time_to(timed, 0.95)},
    }


def test_results_page_renders_the_new_file_and_still_the_old_ones(tmp_path: Path) -> None:
    (tmp_path / "compression_worlds.json").write_text(json.dumps(_data()))
    section = next(s for s in report.SECTIONS if s.key == "compression_worlds")
    text = report.render_section(section, tmp_path, "results/")
    assert "| `int8+ef` | <= 0.5 pp |" in text and "Training time to validation" in text
    assert "load average (1 min) during the runs 2.5-2.5" in text
    # the issue-5 records (one seed, per-run rows) keep rendering with the old table
    old = Path(__file__).parents[2] / "docs/results/compression_quality.json"
    assert "| model | strategy | world |" in compression.quality_table(json.loads(old.read_text()))
    with pytest.raises(KeyError, match="format"):
        compression_worlds.render({"records": []})


def test_plot_has_two_panels_per_model(tmp_path: Path) -> None:
    rows = aggregate(_grid()) + [
        {**r, "model": "cnn"} for r in aggregate(_grid()) if r["spec"] != "int8+ef"
    ]
    out = tmp_path / "plot.png"
    compression_worlds.plot(rows, out)
    from PIL import Image

    with Image.open(out) as img:
        width, height = img.size
    # two models stacked, two panels side by side: taller than wide per model row
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (width, height) == (13 * 120, 9 * 120)


def test_cli_defaults_and_up_front_spec_checks() -> None:
    parser = argparse.ArgumentParser()
    compression.add_arguments(parser)
    args = parser.parse_args(["--quality"])
    assert (args.worlds, args.seeds, args.strategies) == ([2, 4, 8], [0, 1, 2], ["ring"])
    assert (args.global_batch, args.local_clip, args.warmup_epochs) == (64, 5.0, 4.0)
    assert args.time_to is None and args.link == "5g" and args.time_to_world == 4
    with pytest.raises(ConfigError):
        compression_worlds.check_variants([Variant("topk:banana+ef")])
    forced = [Variant("topk:0.01+ef", path="allgather")]
    if "compression_path" in {f.name for f in dataclasses.fields(TrainConfig)}:
        compression_worlds.check_variants(forced)  # the gtopk key merged: accepted
    else:
        with pytest.raises(ConfigError, match="compression_path"):
            compression_worlds.check_variants(forced)


def test_add_to_keeps_an_earlier_run_and_trains_only_what_is_missing(tmp_path: Path) -> None:
    """``--add-to``: an earlier file that already holds the whole grid trains nothing
    (the fake quality_run would fail) and is written back re-aggregated, its time-to block
    kept; a file measured another way is refused."""
    parser = argparse.ArgumentParser()
    compression.add_arguments(parser)
    earlier = tmp_path / "earlier.json"
    records = _grid()
    cfg = {"global_batch": 64, "epochs": 20, "drop_last": True, "seeds": [0, 1, 2]}
    timed = {"target": 0.95, "records": [], "rows": []}
    earlier.write_text(
        json.dumps(
            {
                "format": compression_worlds.FORMAT,
                "config": cfg,
                "records": records,
                "rows": [],
                "time_to": timed,
            }
        )
    )
    out = tmp_path / "out.json"
    argv = [
        "--quality",
        "--worlds",
        "2",
        "4",
        "--models",
        "mlp",
        "--drop-last",
        "--specs",
        "int8+ef",
        "topk:0.01+ef",
        "--add-to",
        str(earlier),
        "--json",
        str(out),
    ]
    args = parser.parse_args(argv)

    def must_not_train(*a: Any, **k: Any) -> dict[str, Any]:
        raise AssertionError("a run the earlier file holds was trained again")

    assert compression_worlds.main(args, args.specs, must_not_train) == 0
    data = json.loads(out.read_text())
    assert data["records"] == records and data["time_to"] == timed
    assert {(r["world"], r["spec"]) for r in data["rows"]} == {
        (w, s) for w in (2, 4) for s in ("none", "int8+ef", "topk:0.01+ef")
    }
    args = parser.parse_args([a for a in argv if a != "--drop-last"])
    with pytest.raises(ConfigError, match="drop_last"):
        compression_worlds.main(args, args.specs, must_not_train)


# ---------------------------------------------------------------------- shipped configs
def _shipped(spec: str, world: int, seed: int, acc: float, wire: int, **extra: Any) -> dict:
    return {
        "model": "digits_mlp",
        "config": "conf/digits_mlp.toml",
        "strategy": "ring",
        "world": world,
        "seed": seed,
        "spec": spec,
        "compression": extra.pop("compression", spec),
        "trained_as": extra.pop("trained_as", spec),
        "compression_path": extra.pop("path", None),
        "accuracy": acc,
        "wire_bytes": wire,
        "batch_size": 32,
        "steps_per_epoch": 22 if world == 2 else 6,
        "load1": 3.0,
        **extra,
    }


def test_shipped_configs_run_as_the_cli_would_and_tabulate_mean_and_sd(tmp_path: Path) -> None:
    """--config (issue 34.3): the file's recipe with the run's world, seed and spec; the
    table gives mean +- sd over the seeds, the mean paired gap and the median ratio."""
    conf = str(Path(__file__).parents[2] / "conf/digits_mlp.toml")
    values = compression_worlds.config_values(conf, 8, 2, Variant("topk:0.01+ef", "allgather"))
    assert (values["num_workers"], values["seed"], values["compression"]) == (8, 2, "topk:0.01+ef")
    assert values["compression_path"] == "allgather" and values["batch_size"] == 32
    assert values["optimizer_kwargs"] == {"momentum": 0.9}  # the job moves it, not the bench
    dgc = compression_worlds.config_values(conf, 4, 0, Variant("topk:0.01+ef:momentum=0.9"))
    assert dgc["optimizer_kwargs"] == {"momentum": 0.0}  # written out: the config's rule
    recs = []
    for seed, base in enumerate((0.97, 0.98, 0.96)):
        recs.append(_shipped("none", 2, seed, base, 3_000_000))
        recs.append(
            _shipped(
                "topk:0.01+ef", 2, seed, base - 0.005, 60_000,
                trained_as="topk:0.01+ef:momentum=0.9", path="allgather",
            )
        )  # fmt: skip
        recs.append(_shipped("none", 8, seed, base, 6_000_000))
        recs.append(_shipped("topk:0.01+ef", 8, seed, base - 0.04, 200_000, path="resparsify_tree"))
    rows = {(r["world"], r["spec"]): r for r in compression_worlds.shipped_rows(recs)}
    two, eight = rows[(2, "topk:0.01+ef")], rows[(8, "topk:0.01+ef")]
    assert two["gap_mean"] == pytest.approx(0.5) and two["ratio"] == pytest.approx(50.0)
    assert two["meets_target"] and not eight["meets_target"]  # 4 pp at world 8
    assert rows[(2, "none")]["accuracy"] == "97.00 ± 1.00"
    data = {
        "format": compression_worlds.SHIPPED_FORMAT,
        "records": recs,
        "rows": list(rows.values()),
    }
    (tmp_path / "compression_shipped.json").write_text(json.dumps(data))
    section = next(s for s in report.SECTIONS if s.key == "compression_shipped")
    text = report.render_section(section, tmp_path, "results/")
    assert "| digits_mlp | 2 | 32 | 22 | `topk:0.01+ef` | 96.50 ± 1.00 | +0.50 |" in text
    assert (
        "`topk:0.01+ef:momentum=0.9` | met |" in text and "| resparsify_tree | - | MISSED |" in text
    )
    assert "Load average (1 min) during the runs 3.0-3.0." in text
    with pytest.raises(KeyError, match="format"):
        compression_worlds.render_shipped({"records": []})
