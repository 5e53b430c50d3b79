"""The batch-inference bench without Spark: arguments, the interleaved order, medians and
ratios, the table and the results page's section."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import pytest

from benchmarks import infer
from benchmarks import report as rp
from benchmarks.cli import build_parser
from sparktrain.errors import ConfigError


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    infer.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_defaults_score_the_issues_million_rows():
    args = parse()
    infer.validate(args)
    assert args.rows == 1_000_000 and args.repeats == 5 and args.arrow_batch == 10_000
    args = parse("--rows", "2000", "--partitions", "4", "--batch-size", "64")
    assert (args.rows, args.partitions, args.batch_size) == (2000, 4, 64)


def test_the_cli_knows_the_bench():
    args = build_parser(bench="infer").parse_args(["infer", "--rows", "10"])
    assert args.what == "infer" and args.rows == 10


@pytest.mark.parametrize(
    "flag", ["--rows", "--partitions", "--repeats", "--batch-size", "--arrow-batch"]
)
def test_arguments_the_bench_cannot_measure_with_are_refused(flag):
    with pytest.raises(ConfigError, match=flag):
        infer.validate(parse(flag, "0"))


def test_every_contender_runs_once_a_round_and_leads_in_turn():
    n = len(infer.CONTENDERS)
    order = list(infer.rounds(infer.CONTENDERS, n))
    assert Counter(order) == {c: n for c in infer.CONTENDERS}
    firsts = [order[i * n] for i in range(n)]
    assert sorted(firsts) == sorted(infer.CONTENDERS)


def test_ratios_are_medians_over_predict_batch_udfs():
    out = infer.summarise(
        {
            "transform": [3.0, 1.0, 2.0],
            "transform_prediction_only": [1.0, 1.5, 0.5],
            "predict_batch_udf": [1.5, 1.6, 1.4],
        }
    )
    medians = {r["contender"]: r["median_s"] for r in out["records"]}
    assert medians == {"transform": 2.0, "transform_prediction_only": 1.0, "predict_batch_udf": 1.5}
    assert out["ratios"]["transform"] == {"ratio": pytest.approx(4 / 3), "met": False}
    assert out["ratios"]["transform_prediction_only"] == {
        "ratio": pytest.approx(2 / 3),
        "met": True,
    }
    assert "predict_batch_udf" not in out["ratios"]


def _report() -> dict:
    times = {
        "transform": [2.0, 2.2],
        "transform_prediction_only": [1.0, 1.2],
        "predict_batch_udf": [1.6, 1.6],
    }
    return {
        "rows": 1000, "partitions": 2, "repeats": 2, "batch_size": 1024, "arrow_batch": 10000,
        "master": "local[2]", "agreement": 1.0, "load": {"before": 0.52, "after": 1.4},
        **infer.summarise(times),
    }  # fmt: skip


def test_the_json_round_trips_and_the_page_renders_it(tmp_path: Path):
    (tmp_path / "bench_infer.json").write_text(json.dumps(_report()))
    section = next(s for s in rp.SECTIONS if s.key == "bench_infer")
    text = rp.render_section(section, tmp_path, "")
    assert "| transform_prediction_only | 1.10 s | 1.00 s | 1.20 s | 909 |" in text
    assert "transform / predict_batch_udf, medians: 1.31 (target <= 1.0: MISSED)" in text
    assert (
        "transform_prediction_only / predict_batch_udf, medians: 0.69 (target <= 1.0: met)" in text
    )
    assert "agree on 100.00%" in text
    assert "Load average (1 min) 0.52 before, 1.40 after." in text
    # a report from before the load was recorded renders without it
    old = {k: v for k, v in _report().items() if k != "load"}
    assert "Load average" not in infer.table(old)


def test_a_missing_json_is_reported_not_run(tmp_path: Path):
    section = next(s for s in rp.SECTIONS if s.key == "bench_infer")
    assert "Not run yet" in rp.render_section(section, tmp_path, "")
