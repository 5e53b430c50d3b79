"""bench sparse's pieces: the Zipf click data, the two-tower model (its sparse flag), the
bench's order, figures, ratios, table and results section; one tiny end-to-end run."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from benchmarks import report as rp
from benchmarks import sparse as sb
from benchmarks.cli import build_parser
from sparktrain import datasets
from sparktrain.errors import ConfigError
from sparktrain.models import two_tower
from sparktrain.sparse.rows import rows_of, sparse_parameters


# ---------------------------------------------------------------------- data
def test_zipf_ids_follow_the_truncated_law():
    n, a = 1000, 1.1
    ids = datasets.zipf_ids(n, 200_000, a, np.random.default_rng(0))
    assert ids.dtype == np.int64 and ids.min() >= 0 and ids.max() < n
    pmf = np.arange(1, n + 1, dtype=np.float64) ** -a
    pmf /= pmf.sum()
    counts = np.bincount(ids, minlength=n) / len(ids)
    # the head, where the law has mass: each id's share within 4 binomial standard
    # deviations of its probability
    sigma = np.sqrt(pmf[:20] * (1 - pmf[:20]) / len(ids))
    assert np.all(np.abs(counts[:20] - pmf[:20]) < 4 * sigma)
    # skew: id 0 alone is about 18 % of the draws, the top 10 % of ids over 70 %
    assert counts[0] > 0.15 and counts[: n // 10].sum() > 0.7
    # and the tail is drawn, not folded or cut: the last half still holds its share
    assert counts[n // 2 :].sum() == pytest.approx(pmf[n // 2 :].sum(), rel=0.1)


def test_zipf_ids_refuse_what_has_no_law():
    rng = np.random.default_rng(0)
    with pytest.raises(ConfigError, match="n >= 1"):
        datasets.zipf_ids(0, 10, 1.1, rng)
    with pytest.raises(ConfigError, match="a > 0"):
        datasets.zipf_ids(10, 10, 0.0, rng)


def test_clicks_are_int64_ids_and_the_same_for_a_seed():
    a = datasets.clicks(5000, 300, 7000, seed=3)
    b = datasets.clicks(5000, 300, 7000, seed=3)
    c = datasets.clicks(5000, 300, 7000, seed=4)
    assert a.user.dtype == np.int64 and a.item.dtype == np.int64
    assert a.user.max() < 300 and a.item.max() < 7000 and a.user.min() >= 0
    assert set(np.unique(a.label)) <= {0.0, 1.0}
    for x, y in ((a.user, b.user), (a.item, b.item), (a.label, b.label)):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a.item, c.item)


def test_clicks_follow_their_hidden_model():
    d = datasets.clicks(50_000, 1000, 10_000, seed=0)
    # the labels are Bernoulli(ctr): calibrated in the bins of ctr
    for lo, hi in ((0.0, 0.2), (0.4, 0.6), (0.8, 1.0)):
        sel = (d.ctr >= lo) & (d.ctr < hi)
        assert sel.sum() > 500
        assert lo - 0.02 < d.label[sel].mean() < hi + 0.02
    # and something to learn: the truth's loss is well below a coin's
    ctr = np.clip(d.ctr, 1e-6, 1 - 1e-6)
    truth = -np.mean(d.label * np.log(ctr) + (1 - d.label) * np.log(1 - ctr))
    assert truth < 0.6 < np.log(2)


def test_clicks_refuse_empty_tables():
    with pytest.raises(ConfigError, match="num_items"):
        datasets.clicks(10, 5, 0)


# ---------------------------------------------------------------------- model
def _step(model: torch.nn.Module, user: torch.Tensor, item: torch.Tensor) -> None:
    out = model(user, item)
    assert out.shape == (len(user),)
    torch.nn.functional.binary_cross_entropy_with_logits(out, torch.ones(len(user))).backward()


def test_sparse_flag_makes_sparse_gradients_of_the_touched_rows():
    user = torch.tensor([0, 3, 3, 9])
    item = torch.tensor([5, 5, 70, 1])
    torch.manual_seed(0)
    sparse = two_tower(10, 100, 8, sparse=True)
    torch.manual_seed(0)
    dense = two_tower(10, 100, 8, sparse=False)
    for (name, p), (_, q) in zip(sparse.named_parameters(), dense.named_parameters(), strict=True):
        assert torch.equal(p, q), name  # the flag changes the gradients, not the weights
    assert [n for n, _ in sparse_parameters(sparse)] == [
        "user.weight",
        "item.weight",
        "user_bias.weight",
        "item_bias.weight",
    ]
    assert sparse_parameters(dense) == []
    _step(sparse, user, item)
    _step(dense, user, item)
    grad = sparse.item.weight.grad
    assert grad is not None and grad.is_sparse
    ids, rows = rows_of(grad)
    assert ids.tolist() == [1, 5, 70] and rows.shape == (3, 8)
    dense_grad = dense.item.weight.grad
    assert dense_grad is not None and not dense_grad.is_sparse
    torch.testing.assert_close(rows, dense_grad[[1, 5, 70]])
    assert dense_grad.abs().sum(dim=1).nonzero().flatten().tolist() == [1, 5, 70]
    assert sparse.bias.grad is not None and not sparse.bias.grad.is_sparse


def test_sparse_and_dense_sgd_train_alike():
    d = datasets.clicks(2048, 50, 500, seed=1)
    user, item = torch.from_numpy(d.user), torch.from_numpy(d.item)
    label = torch.from_numpy(d.label)
    models = []
    for flag in (True, False):
        torch.manual_seed(0)
        model = two_tower(50, 500, 8, sparse=flag)
        opt = torch.optim.SGD(model.parameters(), lr=3.0)
        losses = []
        for s in range(8):
            rows = slice(s * 256, (s + 1) * 256)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(
                model(user[rows], item[rows]), label[rows]
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        models.append(model)
        assert losses[-1] < losses[0]
    for p, q in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_two_tower_refuses_float_ids_and_empty_tables():
    model = two_tower(10, 10, 4)
    with pytest.raises(TypeError, match="int64"):
        model(torch.zeros(2), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="num_items"):
        two_tower(10, 0, 4)


def test_the_default_is_the_issues_table():
    model = two_tower(num_users=10)
    assert tuple(model.item.weight.shape) == (1_000_000, 64) and model.item.sparse


# ---------------------------------------------------------------------- the bench's figures
def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sb.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_defaults_are_the_issues_run():
    args = parse()
    sb.validate(args)
    assert (args.table, args.dim, args.batch, args.workers, args.zipf) == (
        1_000_000,
        64,
        512,
        2,
        1.1,
    )
    assert args.contenders == list(sb.CONTENDERS)


def test_the_cli_knows_the_bench():
    args = build_parser(bench="sparse").parse_args(["sparse", "--table", "100"])
    assert args.what == "sparse" and args.table == 100


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (("--table", "0"), "--table"),
        (("--steps", "5", "--warmup", "5"), "--warmup"),
        (("--lr", "0"), "--lr"),
        (("--contenders", "dense-tree"), "unknown contender"),
    ],
)
def test_arguments_the_bench_cannot_measure_with_are_refused(argv, match):
    with pytest.raises(ConfigError, match=match):
        sb.validate(parse(*argv))


def test_every_contender_runs_once_a_round_and_leads_in_turn():
    order = list(sb.rounds(sb.CONTENDERS, [0, 1], 2))
    assert Counter(order) == {(c, s): 2 for c in sb.CONTENDERS for s in (0, 1)}
    n = len(sb.CONTENDERS)
    firsts = [order[i * n][0] for i in range(4)]
    assert len(set(firsts)) == 4


def test_smooth_and_time_to_loss():
    assert sb.smooth([4.0, 2.0, 0.0, 2.0], 2) == [4.0, 3.0, 1.0, 1.0]
    # the smoothed loss first reaches 1.0 at the third step: 0.1 + 0.2 + 0.3 s
    assert sb.time_to_loss([4.0, 2.0, 0.0, 2.0], [0.1, 0.2, 0.3, 0.4], 1.0, 2) == pytest.approx(0.6)
    assert sb.time_to_loss([4.0, 2.0], [0.1, 0.2], 1.0, 2) is None


def _run(
    name: str, seed: int, step: float, wire: float, curve: list[float], **more: Any
) -> dict[str, Any]:
    rec = {
        "contender": name,
        "seed": seed,
        "loss": curve,
        "step_times_s": [10 * step] + [step] * (len(curve) - 1),  # a slow first step
        "wire_bytes_per_step": wire,
        "wire_bytes_source": "estimated" if name.startswith("ddp") else "measured",
        "call_s": 5.0,
        **more,
    }
    rec.update(sb.measure(rec, 1))
    return rec


def synthetic_runs() -> list[dict[str, Any]]:
    fall = [0.7, 0.6, 0.5, 0.4, 0.3]
    return [
        _run("dense-ring", 0, 1.0, 500e6, fall),
        _run("dense-ring", 1, 1.2, 500e6, [x + 0.02 for x in fall]),
        _run("sparse-ring", 0, 0.04, 1e6, fall),
        _run("sparse-ring", 1, 0.05, 1e6, [x + 0.04 for x in fall]),
        _run("ddp", 0, 0.8, 500e6, fall),
        _run("ddp-sparse", 0, 0.1, 2e6, [x + 0.1 for x in fall]),
        {"contender": "sparse-ps", "seed": 0, "error": "CommError: sparse rows not served"},
    ]


def test_derive_on_synthetic_records():
    d = sb.derive(synthetic_runs(), 1, None)
    # the highest final loss of the median curves: ddp-sparse's 0.4
    assert d["target_loss"] == pytest.approx(0.4)
    c = d["contenders"]
    assert c["dense-ring"]["step_s"] == pytest.approx(1.1)
    assert c["sparse-ring"]["step_s"] == pytest.approx(0.045)
    assert c["sparse-ps"] == {**c["sparse-ps"], "runs": 0, "errors": 1, "step_s": None}
    assert "not served" in c["sparse-ps"]["first_error"]
    r = d["ratios"]["sparse-ring"]
    assert r["step_speedup_vs_dense_ring"] == pytest.approx(1.1 / 0.045)
    assert r["step_met"] is True
    assert r["wire_bytes_reduction_vs_dense_ring"] == pytest.approx(500.0) and r["bytes_met"]
    assert r["curve_gap_vs_dense_ring"] == pytest.approx(0.01)  # medians of the two seeds
    assert d["seed_noise"] == pytest.approx(0.02)
    assert r["curve_within_seed_noise"] is True
    # time to 0.4: dense/sparse ring reach it at step 4 (seed 0) or 5 (seed 1)
    assert d["ddp_best"] == "ddp-sparse"
    ddp_sparse = 10 * 0.1 + 4 * 0.1  # its curve reaches 0.4 only at the fifth step
    assert d["ddp_best_time_to_loss_s"] == pytest.approx(ddp_sparse)
    ring = sb.statistics.median([10 * 0.04 + 3 * 0.04, 10 * 0.05 + 4 * 0.05])
    assert c["sparse-ring"]["time_to_loss_s"] == pytest.approx(ring)
    assert r["time_to_loss_vs_ddp_best"] == pytest.approx(ring / ddp_sparse)
    assert r["ddp_met"] is True
    assert d["ratios"]["ddp"]["ddp_met"] is None  # DDP is not held to beating itself
    assert d["ratios"]["sparse-ps"]["step_speedup_vs_dense_ring"] is None


def test_one_seed_has_no_noise_to_compare_with():
    runs = [r for r in synthetic_runs() if r.get("seed") == 0]
    d = sb.derive(runs, 1, 0.45)
    assert d["target_loss"] == 0.45 and d["seed_noise"] is None
    assert d["ratios"]["sparse-ring"]["curve_within_seed_noise"] is None


def _report(runs: list[dict[str, Any]]) -> dict[str, Any]:
    spec = {
        "table": 1000,
        "users": 100,
        "dim": 8,
        "zipf": 1.1,
        "batch": 64,
        "workers": 2,
        "steps": 5,
        "warmup": 1,
        "lr": 3.0,
        "smooth": 1,
        "data_seed": 0,
        "rows": 768,
    }
    return {
        "spec": spec,
        "seeds": [0, 1],
        "repeats": 1,
        "load_before": [1.0, 1.0, 1.0],
        "load_after": [2.0, 1.0, 1.0],
        "runs": runs,
        "derived": sb.derive(runs, 1, None),
    }


def test_table_lists_every_contender_and_its_error():
    text = sb.table(_report(synthetic_runs()))
    assert "| dense-ring | 2 | 1100.0 ms | 500.00 MB |" in text
    assert "| sparse-ps | 0 (1 failed) | error |" in text
    assert "2.00 MB (est.)" in text
    assert "sparse-ps failed: `CommError: sparse rows not served`" in text
    assert "step time dense-ring/sparse-ring 24.44" in text
    assert "load average [1.0, 1.0, 1.0] before" in text


def test_results_section_renders(tmp_path: Path):
    (tmp_path / "bench_sparse.json").write_text(json.dumps(_report(synthetic_runs())))
    section = next(s for s in rp.SECTIONS if s.key == "bench_sparse")
    text = rp.render_section(section, tmp_path, "results/")
    assert "sparktrain bench sparse" in text and "| ddp-sparse | 1 |" in text


def test_rederive_rewrites_from_the_runs(tmp_path: Path):
    path = tmp_path / "bench_sparse.json"
    report = _report(synthetic_runs())
    report["derived"] = {}
    path.write_text(json.dumps(report))
    assert sb.main(parse("--json", str(path), "--rederive", "--no-plot")) == 0
    assert json.loads(path.read_text())["derived"]["ddp_best"] == "ddp-sparse"


def test_plot_draws(tmp_path: Path):
    sb.plot(_report(synthetic_runs()), tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000


# ---------------------------------------------------------------------- end to end
@pytest.mark.spark
@pytest.mark.scale  # 56 s of call (and minutes of session start) on a loaded machine
def test_a_tiny_bench_runs_the_dense_ring(spark, tmp_path: Path):
    """The harness on real Spark: the dense ring trains the tiny model, its loss falls,
    and its wire bytes are at least the ring's share of the model each step."""
    path = tmp_path / "bench_sparse.json"
    args = parse(
        "--contenders", "dense-ring", "--table", "2000", "--users", "200", "--dim", "8",
        "--batch", "64", "--steps", "6", "--warmup", "1", "--seeds", "0",
        "--json", str(path), "--no-plot",
    )  # fmt: skip
    assert sb.main(args) == 0
    report = json.loads(path.read_text())
    (run,) = report["runs"]
    assert "error" not in run, run.get("error")
    assert len(run["loss"]) == 6 and len(run["step_times_s"]) == 6
    assert run["loss"][-1] < run["loss"][0]
    params = (2000 + 200) * (8 + 1) + 1
    # a two-rank ring sends every gradient byte once per rank: 2 x 4 x params a step
    assert run["raw_bytes_per_step"] >= 2 * 4 * params
    assert run["wire_bytes_per_step"] >= run["raw_bytes_per_step"]
    assert report["derived"]["contenders"]["dense-ring"]["runs"] == 1


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="no /proc/self/io here")
def test_written_bytes_count_what_the_process_writes(tmp_path: Path):
    import os

    before = sb.written_bytes()
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        os.writev(fd, [b"x" * 100_000, b"y" * 23])  # as Gloo writes its sockets
    finally:
        os.close(fd)
    after = sb.written_bytes()
    assert before is not None and after is not None
    assert after - before >= 100_023


def test_compressed_rows_are_compared_with_the_uncompressed_sparse_ring():
    fall = [0.7, 0.6, 0.5, 0.4, 0.3]
    runs = [
        *synthetic_runs(),
        _run("sparse-ring+int8-ef", 0, 0.06, 0.25e6, [x + 0.01 for x in fall]),
        _run("sparse-ring+int8-ef", 1, 0.08, 0.3e6, [x + 0.03 for x in fall]),
    ]
    d = sb.derive(runs, 1, None)
    r = d["ratios"]["sparse-ring+int8-ef"]
    assert r["wire_bytes_reduction_vs_sparse_ring"] == pytest.approx(1e6 / 0.275e6)
    assert r["step_time_vs_sparse_ring"] == pytest.approx(0.07 / 0.045)
    # the median curves of both are fall + 0.02: no gap
    assert r["final_loss_gap_vs_sparse_ring"] == pytest.approx(0.0, abs=1e-12)
    c = d["contenders"]
    want = c["sparse-ring+int8-ef"]["time_to_loss_s"] / c["sparse-ring"]["time_to_loss_s"]
    assert r["time_to_loss_vs_sparse_ring"] == pytest.approx(want)
    assert "wire_bytes_reduction_vs_sparse_ring" not in d["ratios"]["sparse-ring"]
    assert "vs sparse-ring: wire bytes 3.64x fewer" in sb.table(_report(runs))
    keys = sb.contender_keys("sparse-ring+int8row-ef", dim=32)[1]
    assert keys["compression"] == {"*.weight": "int8:chunk=32+ef", "*": "none"}
