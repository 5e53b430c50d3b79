"""Sample weights without Spark: the weighted losses, and the exactness claim — with the
driver's normalisation ``w / mean(w)`` and per-batch losses ``sum w_i l_i / n``, the
distributed full-batch gradient (ring, tree, tree_aggregate; uneven and empty partitions)
is the gradient of the weighted mean loss ``sum w_i l_i / sum w_i`` computed directly in
torch, and an epoch's round contributions add up to it."""

from __future__ import annotations

import copy
import functools
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from sparktrain.builders import build_loss, check_weighted_loss
from sparktrain.config import TrainConfig
from sparktrain.data.partition_data import PartitionData
from sparktrain.errors import ConfigError
from sparktrain.models import mlp
from sparktrain.result import assemble as _assemble
from sparktrain.result import state_to_bytes
from sparktrain.strategies.tree_aggregate.codec import SAMPLES, merge
from sparktrain.strategies.tree_aggregate.flat import flatten
from sparktrain.strategies.tree_aggregate.task import Block, RoundSpec, partition_round
from sparktrain.task.context import JobSpec

from .fixtures import pipeline_records, train_in_threads

pytestmark = pytest.mark.timeout(120)

WIDTH, CLASSES = 4, 3


def _weighted_parts(sizes: list[int], seed: int = 0) -> list[PartitionData]:
    """Partitions with raw weights in [0, 5) (some exactly 0), normalised as prepare() does:
    divided by their mean over all training rows."""
    rng = np.random.default_rng(seed)
    raw = [rng.uniform(0, 5, n) * (rng.random(n) > 0.2) for n in sizes]
    mean = np.concatenate(raw).mean()
    return [
        PartitionData(
            rng.standard_normal((n, WIDTH)).astype(np.float32),
            rng.integers(0, CLASSES, n).astype(np.float64),
            np.zeros(n, bool),
            w / mean,
        )
        for n, w in zip(sizes, raw, strict=True)
    ]


def _reference_grad(model: torch.nn.Module, parts: list[PartitionData]) -> list[torch.Tensor]:
    """The gradient of sum w_i l_i / sum w_i over all rows, straight from torch (float64)."""
    ref = copy.deepcopy(model).double()
    x = torch.from_numpy(np.concatenate([p.x for p in parts])).double()
    y = torch.from_numpy(np.concatenate([p.y for p in parts])).long()
    w = torch.from_numpy(np.concatenate([p.w for p in parts if p.w is not None]))
    per_row = F.cross_entropy(ref(x), y, reduction="none")
    ((per_row * w).sum() / w.sum()).backward()
    return [p.grad.detach().clone() for p in ref.parameters() if p.grad is not None]


# ------------------------------------------------------------------ the loss
def test_unweighted_call_is_exactly_the_configured_mean_loss() -> None:
    out, y = torch.randn(9, 3), torch.randint(0, 3, (9,))
    loss = build_loss("cross_entropy", {"label_smoothing": 0.1})
    assert torch.equal(loss(out, y), F.cross_entropy(out, y, label_smoothing=0.1))


@pytest.mark.parametrize(
    ("name", "out_shape", "target"),
    [
        ("cross_entropy", (8, 3), lambda: torch.randint(0, 3, (8,))),
        ("mse", (8, 1), lambda: torch.randn(8, 1)),
        ("mse", (8, 2), lambda: torch.randn(8, 2)),
        ("bce_with_logits", (8, 1), lambda: torch.randint(0, 2, (8, 1)).float()),
    ],
)
def test_weighted_loss_is_sum_of_weighted_row_losses_over_n(name, out_shape, target) -> None:
    torch.manual_seed(0)
    out, y = torch.randn(*out_shape), target()
    w = torch.rand(8) * 3
    loss = build_loss(name, {})
    per_row = {
        "cross_entropy": lambda: F.cross_entropy(out, y, reduction="none"),
        "mse": lambda: F.mse_loss(out, y, reduction="none").mean(dim=1),
        "bce_with_logits": lambda: F.binary_cross_entropy_with_logits(
            out, y, reduction="none"
        ).mean(dim=1),
    }[name]()
    torch.testing.assert_close(loss(out, y, w), (w * per_row).sum() / 8, rtol=1e-6, atol=1e-7)
    # weights of 1 give the mean loss (named losses without class weights)
    torch.testing.assert_close(loss(out, y, torch.ones(8)), loss(out, y), rtol=1e-6, atol=1e-7)


def test_loss_module_and_functional_callables_take_weights() -> None:
    out, y, w = torch.randn(6, 1), torch.randn(6, 1), torch.rand(6)
    huber = build_loss(torch.nn.HuberLoss(delta=0.5), {})
    expected = (F.huber_loss(out, y, delta=0.5, reduction="none")[:, 0] * w).sum() / 6
    torch.testing.assert_close(huber(out, y, w), expected)
    functional = build_loss(F.l1_loss, {})
    expected = ((out - y).abs()[:, 0] * w).sum() / 6
    torch.testing.assert_close(functional(out, y, w), expected)
    check_weighted_loss(F.l1_loss, {})
    check_weighted_loss("mse", {})


def test_a_callable_without_per_row_losses_is_refused_with_a_way_out() -> None:
    def my_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ((out - target) ** 2).mean()

    with pytest.raises(ConfigError, match="reduction.*keyword.*or drop the weight column"):
        check_weighted_loss(my_loss, {})
    built = build_loss(my_loss, {})
    out = torch.randn(4, 1)
    assert torch.equal(built(out, out), torch.zeros(()))  # unweighted: still fine
    with pytest.raises(ConfigError, match="cannot|one loss per row"):
        built(out, out, torch.ones(4))


def test_a_reduction_keyword_that_still_reduces_is_caught() -> None:
    def mean_anyway(out: torch.Tensor, target: torch.Tensor, reduction: str = "mean"):
        return ((out - target) ** 2).mean()

    with pytest.raises(ConfigError, match=r"returned shape \(\) .* 4 rows"):
        build_loss(mean_anyway, {})(torch.randn(4, 1), torch.randn(4, 1), torch.ones(4))


# ------------------------------------------------------------------ ring / tree, end to end
def _spec(world: int, strategy: str) -> JobSpec:
    cfg = TrainConfig(
        epochs=1,
        batch_size=1000,  # one full batch per rank: the step's gradient is the full gradient
        lr=1.0,
        optimizer="sgd",
        shuffle=False,
        progress=False,
        comm_timeout=10.0,
        num_workers=world,
        strategy=strategy,
    )
    return JobSpec(
        job_id="w",
        attempt=0,
        secret=b"k" * 32,
        config=cfg,
        model_fn=functools.partial(mlp, WIDTH, (8,), CLASSES),
        model_kwargs={},
        feature_width=WIDTH,
        num_outputs=CLASSES,
    )


@pytest.mark.parametrize("strategy", ["ring", "tree"])
@pytest.mark.parametrize("sizes", [[7, 3], [5, 0, 9], [11, 2, 6, 1]])
def test_full_batch_step_is_the_weighted_mean_gradient(strategy, sizes) -> None:
    spec = _spec(len(sizes), strategy)
    parts = _weighted_parts(sizes)

    records = [r for out in train_in_threads(spec, parts) for r in out]
    torch.manual_seed(0)
    initial = spec.model_fn()
    result = _assemble(copy.deepcopy(initial), records, spec.config, wall_s=1.0, stage_s=1.0)
    # SGD with lr=1 from the same initial weights: after - before = -gradient
    got = [
        (a - b).detach()
        for a, b in zip(initial.parameters(), result.model.parameters(), strict=True)
    ]
    for g, want in zip(got, _reference_grad(initial, parts), strict=True):
        torch.testing.assert_close(g.double(), want, rtol=0, atol=1e-6)
    # the reported training loss is the weighted mean loss
    x = torch.from_numpy(np.concatenate([p.x for p in parts]))
    y = torch.from_numpy(np.concatenate([p.y for p in parts])).long()
    w = torch.from_numpy(np.concatenate([p.w for p in parts if p.w is not None]))
    with torch.no_grad():
        weighted = (F.cross_entropy(initial(x), y, reduction="none").double() * w).sum() / w.sum()
    assert result.history[0]["loss"] == pytest.approx(float(weighted), rel=1e-5)
    assert result.summary["replicas_in_sync"]
    stats = [json.loads(r.data) for r in records if r.kind == "stats"]
    assert sum(s["train_rows"] for s in stats) == sum(sizes)


# ------------------------------------------------------------------ tree_aggregate rounds
def _round_spec(cfg: TrainConfig, model: torch.nn.Module, blocks: list[Block], job: str):
    rpe = max(1, -(-max(b.train.size for b in blocks) // cfg.batch_size))
    state = state_to_bytes(model.state_dict())
    model_fn = functools.partial(mlp, WIDTH, (8,), CLASSES)
    return RoundSpec(job, cfg, state, rpe, evaluate_on_validation=False, model_fn=model_fn)


def _epoch_gradient(batch_size: int, sizes: list[int], job: str) -> tuple[np.ndarray, np.ndarray]:
    """(sum of one epoch's round contributions / samples, reference weighted gradient),
    every round starting from the same weights."""
    cfg = TrainConfig(
        strategy="tree_aggregate", batch_size=batch_size, lr=0.1, optimizer="sgd", progress=False
    )
    parts = _weighted_parts(sizes, seed=3)
    blocks = [Block(i, p, p.select(np.zeros(p.size, bool))) for i, p in enumerate(parts)]
    torch.manual_seed(0)
    model = mlp(WIDTH, (8,), CLASSES)
    spec = _round_spec(cfg, model, blocks, job)
    weights = flatten(list(model.parameters()))
    total = None
    for r in range(spec.rounds_per_epoch):
        for b in blocks:
            total = merge(total, partition_round(spec, weights, b, r), spec.codec)
    assert total is not None
    got = spec.codec.decode(total[0]) / total[1][SAMPLES]
    assert total[1][SAMPLES] == sum(sizes)
    ref = np.concatenate([g.numpy().ravel() for g in _reference_grad(model, parts)])
    return got, ref


def test_tree_aggregate_full_batch_round_is_the_weighted_mean_gradient() -> None:
    got, ref = _epoch_gradient(1000, [13, 0, 6], "weights-full")
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-6)


def test_an_epoch_of_minibatch_rounds_adds_up_to_the_weighted_mean_gradient() -> None:
    # each round's averaged gradient estimates the full one; summed sample-weighted over
    # an epoch (the same weights every round) the estimates are exactly the full gradient
    got, ref = _epoch_gradient(4, [13, 6], "weights-mini")
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-6)


# ------------------------------------------------------------------ pipeline stages
@pytest.mark.parametrize(("stages", "replicas", "sizes"), [(2, 1, [9, 4]), (2, 2, [6, 0, 3, 8])])
def test_pipeline_full_batch_step_is_the_weighted_mean_gradient(stages, replicas, sizes) -> None:
    from sparktrain.parallel.partition import partition
    from sparktrain.parallel.pipeline import assemble
    from sparktrain.parallel.stage import PipelineSpec

    def model_fn() -> torch.nn.Sequential:
        return mlp(WIDTH, (8, 6), CLASSES)

    cfg = TrainConfig(
        epochs=1,
        batch_size=1000,  # one step per row over all of its rows
        lr=1.0,
        optimizer="sgd",
        shuffle=False,
        progress=False,
        comm_timeout=20.0,
        num_workers=stages * replicas,
        parallelism_pipeline=stages,
        parallelism_data=replicas,
    )
    job = JobSpec(
        job_id="pw",
        attempt=0,
        secret=b"s" * 32,
        config=cfg,
        model_fn=model_fn,
        model_kwargs={},
        feature_width=WIDTH,
        num_outputs=CLASSES,
    )
    torch.manual_seed(cfg.seed)
    spec = PipelineSpec(job, partition(model_fn(), stages, WIDTH, balance="params"), replicas, 3)
    parts = _weighted_parts(sizes, seed=5)

    records = pipeline_records(spec, parts)
    torch.manual_seed(cfg.seed)
    initial = model_fn()
    result = assemble(copy.deepcopy(initial), records, spec, wall_s=1.0, stage_s=1.0)
    got = [
        (a - b).detach()
        for a, b in zip(initial.parameters(), result.model.parameters(), strict=True)
    ]
    for g, want in zip(got, _reference_grad(initial, parts), strict=True):
        torch.testing.assert_close(g.double(), want, rtol=0, atol=1e-6)
