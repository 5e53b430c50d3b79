"""The defaults bench without Spark: arguments, the configs of our fits, mean ± sd, the
table and the results page's section."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from benchmarks import defaults
from benchmarks import report as rp
from benchmarks.cli import build_parser
from sparktrain.config import TrainConfig
from sparktrain.errors import ConfigError


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    defaults.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_defaults_measure_every_data_set_on_three_seeds():
    args = parse()
    defaults.validate(args)
    assert args.datasets == list(defaults.WORKLOADS)
    assert {"digits", "digits_cnn", "breast_cancer", "diabetes", "california"} <= set(args.datasets)
    assert args.seeds == [0, 1, 2] and args.num_workers == 2
    assert args.contenders == ["new", "old", "mllib"]
    args = parse("--datasets", "diabetes", "--seeds", "4", "--contenders", "new", "mllib")
    assert (args.datasets, args.seeds, args.contenders) == (["diabetes"], [4], ["new", "mllib"])


def test_the_cli_knows_the_bench():
    args = build_parser(bench="defaults").parse_args(["defaults", "--seeds", "7"])
    assert args.what == "defaults" and args.seeds == [7]


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--datasets", "mnist"], "unknown mnist"),
        (["--num-workers", "0"], "--num-workers"),
        (["--test-fraction", "1"], "--test-fraction"),
    ],
)
def test_arguments_the_bench_cannot_measure_with_are_refused(argv, match):
    with pytest.raises(ConfigError, match=match):
        defaults.validate(parse(*argv))


def test_the_new_defaults_pass_only_model_data_workers_and_loss():
    new = defaults.config_kwargs("new", "regression", 1, 2, landed=True, has_feature_scaling=True)
    assert new == {"num_workers": 2, "seed": 1, "progress": False, "loss": "mse"}
    assert defaults.config_kwargs("new", "classification", 0, 2, True, True) == {
        "num_workers": 2, "seed": 0, "progress": False,
    }  # fmt: skip


def test_before_the_defaults_land_the_new_settings_are_given():
    new = defaults.config_kwargs("new", "regression", 0, 2, landed=False, has_feature_scaling=False)
    assert new["optimizer"] == "adam" and new["lr"] == 1e-3 and new["epochs"] == 50
    assert new["label_scaling"] is True and "feature_scaling" not in new
    line = defaults.settings_line(landed=False, has_feature_scaling=False)
    assert "passed explicitly" in line and "no feature_scaling" in line


def test_the_old_defaults_switch_every_scaling_off():
    old = defaults.config_kwargs("old", "regression", 0, 2, landed=True, has_feature_scaling=True)
    assert old["optimizer"] == "sgd" and old["lr"] == 0.01 and old["epochs"] == 10
    assert old["label_scaling"] is False and old["feature_scaling"] is False
    TrainConfig(**old).validate()  # a config the package takes
    with pytest.raises(ConfigError, match="ours"):
        defaults.config_kwargs("mllib", "regression", 0, 2, True, True)


def test_the_landed_check_reads_the_config_class():
    @dataclasses.dataclass
    class Before:
        optimizer: str = "sgd"
        lr: float = 0.01

    @dataclasses.dataclass
    class After:
        optimizer: str = "adam"
        lr: float = 1e-3
        feature_scaling: str = "auto"

    assert not defaults.defaults_landed(Before)
    assert defaults.defaults_landed(After)


def test_mean_sd_and_the_summary_leave_failed_runs_out():
    assert defaults.mean_sd([]) is None
    assert defaults.mean_sd([0.5]) == (0.5, 0.0)
    mean, sd = defaults.mean_sd([1.0, 2.0, 3.0])
    assert (mean, sd) == (2.0, 1.0)
    runs = [
        {"contender": "new", "seed": 0, "metric": 0.9, "fit_s": 10.0},
        {"contender": "new", "seed": 1, "metric": 0.8, "fit_s": 12.0},
        {"contender": "old", "seed": 0, "metric": None, "fit_s": None, "error": "Diverged"},
        {"contender": "old", "seed": 1, "metric": float("nan"), "fit_s": 3.0},
        {"contender": "mllib", "seed": 0, "metric": 0.95, "fit_s": 2.0},
    ]
    s = defaults.summarise(runs)
    assert s["new"]["metric"] == pytest.approx((0.85, 0.0707), abs=1e-4)
    assert s["old"] == {
        "metric": None, "fit_s": None, "runs": 2, "failed": 2, "errors": ["Diverged"],
    }  # fmt: skip
    assert defaults.shortfall(s) == pytest.approx(0.10)
    assert defaults.shortfall({**s, "new": s["old"]}) is None


def test_r2_is_scikit_learns():
    assert defaults.r2([1.0, 2.0, 3.0], [1.0, 2.0, 3.0]) == 1.0
    assert defaults.r2([1.0, 2.0, 3.0], [2.0, 2.0, 2.0]) == 0.0


def _report() -> dict:
    runs = [
        {"contender": c, "seed": seed, "metric": m + 0.01 * seed, "fit_s": t}
        for seed in (0, 1, 2)
        for c, m, t in (("new", 0.90, 30.0), ("old", 0.50, 5.0), ("mllib", 0.95, 4.0))
    ]
    summary = defaults.summarise(runs)
    return {
        "command": defaults.COMMAND, "master": "local[2]", "num_workers": 2,
        "seeds": [0, 1, 2], "test_fraction": 0.25, "defaults_landed": True,
        "settings": defaults.settings_line(True, True),
        "load_before": "load average 3.00, 2.00, 1.00 on 2 CPUs",
        "load_after": "load average 4.00, 3.00, 2.00 on 2 CPUs",
        "tree": {
            "head": "0123456789abcdef",
            "uncommitted": ["sparktrain/x.py", "sparktrain/config.py"],
        },
        "workloads": [
            {
                "name": "breast_cancer", "task": "classification", "metric": "accuracy",
                "model": "mlp(in_features=30, out_features=2)", "shape": "569 × 30",
                "runs": runs, "summary": summary, "shortfall": defaults.shortfall(summary),
            },
            {
                "name": "california", "task": "regression", "metric": "R²",
                "model": "mlp(in_features=8, out_features=1)",
                "not_measured": "no download here",
            },
        ],
    }  # fmt: skip


def test_the_table_shows_mean_sd_the_gap_and_the_rows_not_measured():
    text = defaults.table(_report())
    assert (
        "| breast_cancer | 569 × 30 | `mlp(in_features=30, out_features=2)` | accuracy "
        "| 0.910 ± 0.010 | 0.510 ± 0.010 | 0.960 ± 0.010 | +0.050 ⚠ | 30.0 / 5.0 / 4.0 |"
    ) in text
    assert "| california | - | `mlp(in_features=8, out_features=1)` | R² " in text
    assert "not measured: no download here" in text
    assert "load average 3.00, 2.00, 1.00 on 2 CPUs" in text
    assert (
        "sparktrain at 0123456789 with 2 uncommitted files under sparktrain/ "
        "(config.py among them)." in text
    )
    assert "fall short of MLlib's by more than 0.02: breast_cancer by 0.050" in text


def test_the_json_round_trips_and_the_page_renders_it(tmp_path: Path):
    (tmp_path / "bench_defaults.json").write_text(json.dumps(_report()))
    section = next(s for s in rp.SECTIONS if s.key == "bench_defaults")
    assert section.command == defaults.COMMAND
    text = rp.render_section(section, tmp_path, "")
    assert defaults.COMMAND in text and "| 0.910 ± 0.010 |" in text


def test_a_missing_json_is_reported_not_run(tmp_path: Path):
    section = next(s for s in rp.SECTIONS if s.key == "bench_defaults")
    assert "Not run yet" in rp.render_section(section, tmp_path, "")
