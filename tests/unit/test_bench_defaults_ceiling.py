"""The defaults-ceiling bench without running it: its settings, its optimizers and
schedules, its scaling, one tiny emulated fit, its table and its place in the CLI and on
the results page."""

from __future__ import annotations

import argparse
from itertools import pairwise

import numpy as np
import pytest
import torch
from torch import nn

from benchmarks import defaults_ceiling as dc
from benchmarks import report as rp
from benchmarks.cli import build_parser
from benchmarks.defaults import Workload
from sparktrain.config import TrainConfig
from sparktrain.errors import ConfigError


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    dc.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_cli_knows_the_bench_and_its_defaults():
    args = build_parser(bench="defaults-ceiling").parse_args(["defaults-ceiling"])
    assert args.what == "defaults-ceiling"
    assert args.inits == 1 and args.seeds == [0, 1, 2]
    assert args.datasets == ["diabetes", "digits", "breast_cancer"]
    assert args.json == "docs/results/defaults_ceiling.json"
    args = build_parser(bench="defaults-ceiling").parse_args(
        ["defaults-ceiling", "--inits", "5", "--json", "/tmp/x.json"]
    )
    assert (args.inits, args.json) == (5, "/tmp/x.json")


def test_the_results_page_runs_the_command_the_bench_records():
    section = next(s for s in rp.SECTIONS if s.key == "defaults_ceiling")
    assert section.command == dc.COMMAND and section.json_name == "defaults_ceiling.json"
    keys = [s.key for s in rp.SECTIONS]
    assert keys.index("defaults_ceiling") == keys.index("bench_defaults") + 1
    argv = dc.COMMAND.split()[2:]  # without "sparktrain bench"
    args = build_parser(bench=argv[0]).parse_args(argv)
    assert args.what == "defaults-ceiling" and args.json == "docs/results/defaults_ceiling.json"


@pytest.mark.parametrize(
    ("argv", "match"),
    [(["--inits", "0"], "--inits"), (["--test-fraction", "1"], "--test-fraction")],
)
def test_arguments_the_bench_cannot_run_with_are_refused(argv, match):
    with pytest.raises(ConfigError, match=match):
        dc.validate(parse(*argv))


def test_the_defaults_candidate_is_what_trainconfig_ships():
    cfg = TrainConfig()
    shipped = dc.CANDIDATES["defaults"]
    assert cfg.optimizer == shipped.optimizer == "adam"
    assert (cfg.lr, cfg.epochs, cfg.batch_size) == (dc.LR, dc.EPOCHS, dc.BATCH_SIZE)
    assert shipped.weight_decay == 0 and not shipped.cosine and shipped.patience is None
    assert dc.GLOBAL_BATCH == 64
    assert set(dc.CANDIDATES) == {"defaults", "adamw", "early_stop_5", "early_stop_10", "cosine"}


def test_each_candidate_builds_its_optimizer():
    model = nn.Linear(3, 1)
    opt, sched = dc.build_optimizer(model.parameters(), dc.CANDIDATES["defaults"], 1e-3, 10)
    assert type(opt) is torch.optim.Adam and sched is None
    assert opt.param_groups[0]["weight_decay"] == 0
    opt, sched = dc.build_optimizer(model.parameters(), dc.CANDIDATES["adamw"], 1e-3, 10)
    assert type(opt) is torch.optim.AdamW and sched is None
    assert opt.param_groups[0]["weight_decay"] == 0.1
    with pytest.raises(ConfigError, match="optimizer"):
        dc.build_optimizer(model.parameters(), dc.Candidate("x", "x", optimizer="sgd"), 1e-3, 1)


def test_cosine_decays_to_zero_after_the_last_step():
    model = nn.Linear(3, 1)
    steps = 10
    opt, sched = dc.build_optimizer(model.parameters(), dc.CANDIDATES["cosine"], 1e-3, steps)
    assert type(opt) is torch.optim.Adam and sched is not None
    rates = []
    for _ in range(steps):
        model(torch.ones(2, 3)).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        rates.append(opt.param_groups[0]["lr"])
    assert rates[steps // 2 - 1] == pytest.approx(5e-4)
    assert rates[-1] == pytest.approx(0.0, abs=1e-15)
    assert all(a > b for a, b in pairwise(rates))


def test_standardisation_is_the_population_one_with_the_training_figures():
    from sklearn.preprocessing import StandardScaler

    rng = np.random.default_rng(0)
    train = rng.normal(5, 3, size=(20, 3))
    train[:, 2] = 7.0  # a constant feature keeps scale 1
    test = rng.normal(5, 3, size=(6, 3))
    (a, b), mean, std = dc.standardise(train, test)
    scaler = StandardScaler().fit(train)
    np.testing.assert_allclose(a, scaler.transform(train))
    np.testing.assert_allclose(b, scaler.transform(test))
    np.testing.assert_allclose(std[:2], train[:, :2].std(axis=0, ddof=0))
    assert std[2] == 1.0 and mean[2] == 7.0
    np.testing.assert_allclose(b[:, 2], test[:, 2] - 7.0)


def test_the_hold_out_is_a_tenth_disjoint_and_seeded():
    val, train = dc.holdout_indices(331, seed=0)
    assert len(val) == 33 and len(train) == 298
    assert sorted(torch.cat([val, train]).tolist()) == list(range(331))
    assert torch.equal(val, dc.holdout_indices(331, seed=0)[0])
    assert not torch.equal(val, dc.holdout_indices(331, seed=1)[0])


TINY = Workload(
    "tiny", "none", "regression", "sparktrain.models:mlp",
    {"in_features": 2, "hidden": 4, "out_features": 1},
)  # fmt: skip


def _tiny_data() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(50, 2)) * [1.0, 100.0]
    y = 300 + 40 * x[:, 0] + 0.2 * x[:, 1] + rng.normal(size=50)
    return x[:40], x[40:], y[:40], y[40:]


def test_a_tiny_fit_records_its_curve_and_is_seeded():
    data = _tiny_data()
    out = dc.fit(TINY, data, dc.CANDIDATES["defaults"], 0, 0, epochs=4, lr=0.05, curve=True)
    assert out["stopped"] == 4 and len(out["curve"]) == 4
    assert out["metric"] == out["curve"][-1]  # in label units: R² of the last epoch
    again = dc.fit(TINY, data, dc.CANDIDATES["defaults"], 0, 0, epochs=4, lr=0.05)
    assert again["metric"] == out["metric"] and "curve" not in again
    other = dc.fit(TINY, data, dc.CANDIDATES["defaults"], 0, 1, epochs=4, lr=0.05)
    assert other["metric"] != out["metric"]


def test_early_stopping_stops_after_patience_epochs_without_progress():
    data = _tiny_data()
    # lr 0: the validation loss never improves after the first epoch
    stopper = dc.Candidate("es", "es", patience=2)
    out = dc.fit(TINY, data, stopper, 0, 0, epochs=10, lr=0.0)
    assert out["stopped"] == 3


def _report() -> dict:
    def entry(name: str, metric: str, base: float) -> dict:
        return {
            "name": name,
            "metric": metric,
            "linear": {"splits": [base, base + 0.02]},
            "oracle": {"splits": [base + 0.05, base + 0.06], "epochs": [[8], [23]]},
            "candidates": {
                c: {
                    "splits": [base - 0.01, base + 0.01],
                    "runs": [{"stopped": 20}, {"stopped": 50}],
                }
                for c in dc.CANDIDATES
            },
        }

    return {
        "seeds": [0, 1],
        "inits": 1,
        "test_fraction": 0.25,
        "emulation": {"torch_threads": 1, "global_batch": 64, "num_workers": 2,
                      "batch_size": 32, "lr": 0.001, "epochs": 50},
        "seconds": 15.3,
        "load_before": "load average 1.00, 1.00, 1.00 on 2 CPUs",
        "load_after": "load average 2.00, 2.00, 2.00 on 2 CPUs",
        "candidates": [{"key": c.key, "title": c.title} for c in dc.CANDIDATES.values()],
        "datasets": [entry("diabetes", "R²", 0.4), entry("digits", "accuracy", 0.9)],
    }  # fmt: skip


def test_the_table_renders_every_row_from_the_json():
    text = dc.table(_report())
    lines = text.splitlines()
    assert lines[0].startswith("Splits 0, 1 (75%/25%); 1 init seed per split; plain torch")
    assert "global batch 64 (2 workers × 32)" in lines[0] and "15 s in all" in lines[0]
    assert "before: load average 1.00" in lines[0] and "after: load average 2.00" in lines[0]
    rows = [line for line in lines if line.startswith("| ")]
    assert rows[0].startswith("| candidate | diabetes R² per split | mean | digits accuracy")
    assert lines[lines.index(rows[0]) + 1] == "|---|---|---:|---|---:|---|"
    body = rows[1:]
    assert len(body) == 2 + len(dc.CANDIDATES)  # linear, the candidates, the oracle
    assert body[0] == f"| {dc.LINEAR_TITLE} | 0.400 / 0.420 | 0.410 | 0.900 / 0.920 | 0.910 |  |"
    stop = next(r for r in body if r.startswith("| early stopping, 10 % hold-out, patience 5"))
    assert stop.endswith("| diabetes 20,50; digits 20,50 |")
    assert "| 0.390 / 0.410 | 0.400 |" in stop
    assert body[-1] == (
        f"| {dc.ORACLE_TITLE} | 0.450 / 0.460 | 0.455 | 0.950 / 0.960 | 0.955 "
        "| diabetes best at 8,23; digits best at 8,23 |"
    )


def test_the_table_names_several_inits():
    data = _report()
    data["inits"] = 5
    assert "5 init seeds per split (per split: their mean)" in dc.table(data)
