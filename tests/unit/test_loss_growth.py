"""A run whose loss grows by orders of magnitude without ever turning NaN stops with a
``DivergedError`` on every rank at the same epoch, saying what to try (issue 32); runs
that learn, bump, or start huge and fall do not trip it."""

from __future__ import annotations

from typing import Any

import pytest

from sparktrain.config import TrainConfig
from sparktrain.errors import ConfigError, DivergedError
from sparktrain.task.divergence import check_loss_growth, loss_blowup
from sparktrain.task.run_task import run_partition

from .fixtures import loop_spec, random_parts, run_ranks, train_and_assemble, worker_context

pytestmark = pytest.mark.timeout(120)

# Epoch mean training losses of conf/digits_mlp.toml (ring, world 2, local[2], seed 0,
# SGD lr 0.1 momentum 0.9, 20 epochs) measured with `sparktrain train conf/digits_mlp.toml
# --set compression=...` (the guard off): the first two ended at test accuracy 0.06 and
# 0.10, the last two at 0.91 and 0.98.
RANDOMK_EF = [2.2889, 2.0607, 1.4834, 1.3903, 4.4942, 19.7439, 29.6519, 75.0308, 184.1247]
RANDOMK_MOMENTUM_CORRECTION = [2.2884, 2.0749, 1.5842, 1.5403, 3.3693, 13.9007, 18.3597, 52.7116]
RANDOMK_EF_MOMENTUM_0 = [2.3050, 2.2659, 2.1969, 2.1157, 2.0002, 1.8340, 1.6532, 1.4082, 0.2610]
UNCOMPRESSED = [
    1.8418, 0.5059, 0.2120, 0.1582, 0.1136, 0.2031, 0.1414, 0.1107, 0.0767, 0.0586,
    0.0573, 0.1018, 0.0734, 0.0530, 0.0368, 0.0363, 0.0262, 0.0300, 0.0281, 0.0235,
]  # fmt: skip


def first_trip(losses: list[float], factor: float = 20.0) -> int | None:
    """The 0-based epoch at which the guard stops the run, or None."""
    return next(
        (i for i in range(1, len(losses)) if loss_blowup(losses[: i + 1], factor) is not None),
        None,
    )


def test_the_default_factor_stops_the_digits_runs_that_diverged_and_no_other():
    assert TrainConfig().divergence_factor == 20.0
    assert first_trip(RANDOMK_EF) == 6  # epoch 7: 29.7 > 20 x 1.39
    assert first_trip(RANDOMK_MOMENTUM_CORRECTION) == 7  # epoch 8: 52.7 > 20 x 1.54
    assert first_trip(RANDOMK_EF_MOMENTUM_0) is None
    assert first_trip(UNCOMPRESSED) is None
    # 100x would have let the momentum-correction run end at chance (peak 50x its best)
    assert first_trip(RANDOMK_MOMENTUM_CORRECTION, factor=100.0) is None


def test_a_loss_trained_near_zero_may_bump_back_up():
    # the reference never falls below half the first epoch's mean: 0.001 -> 1.0 is a
    # bump of a memorised training set, not a divergence; 10x the first epoch's is
    assert first_trip([2.3, 0.5, 0.01, 0.001, 1.0, 0.002]) is None
    assert loss_blowup([2.3, 0.5, 0.01, 0.001, 23.5], 20.0) == (0, 1.15)


def test_a_regression_loss_that_starts_huge_and_falls_is_left_alone():
    assert first_trip([3.1e4, 2.0e3, 40.0, 3.0, 2.5, 2.8, 2.6]) is None
    # half the first epoch's mean is then the scale: back near the start is no stop,
    # 10x the first epoch's is
    assert loss_blowup([3.1e4, 2.0e3, 40.0, 3.0, 2.5e4], 20.0) is None
    assert loss_blowup([3.1e4, 2.0e3, 40.0, 3.0, 3.2e5], 20.0) == (0, 1.55e4)
    # a loss that barely fell keeps the lowest epoch as its scale
    assert loss_blowup([4.0, 3.0, 61.0], 20.0) == (1, 3.0)


@pytest.mark.parametrize(
    "losses, factor",
    [
        ([2.3], 20.0),  # one epoch: no reference yet
        ([2.3, 500.0], 0.0),  # off
        ([0.0, 0.0, 5.0], 20.0),  # a first epoch without scale
        ([-1.5, -3.0, 40.0], 20.0),  # a loss that can be negative (e.g. a Gaussian NLL)
    ],
)
def test_the_check_is_off_without_a_scale(losses: list[float], factor: float):
    assert loss_blowup(losses, factor) is None


def _history(losses: list[float]) -> list[dict[str, Any]]:
    return [{"type": "epoch", "epoch": i, "loss": v} for i, v in enumerate(losses)]


def test_the_error_says_what_to_try_for_a_compressor_with_momentum():
    cfg = TrainConfig(
        compression="randomk:0.01+ef", lr=0.1, optimizer="sgd", optimizer_kwargs={"momentum": 0.9}
    )
    check_loss_growth(_history(RANDOMK_EF[:6]), RANDOMK_EF[6] / 2, 6, cfg)  # 10.7x: no stop
    with pytest.raises(DivergedError) as err:
        check_loss_growth(_history(RANDOMK_EF[:6]), RANDOMK_EF[6], 6, cfg)
    message = str(err.value)
    assert message.startswith(
        "epoch 7: the mean training loss is 29.65, 21x 1.39 (epoch 4's mean, the lowest"
    )
    assert "compression='randomk:0.01+ef' with the optimizer's momentum at 0" in message
    assert "optimizer_kwargs={momentum = 0}" in message
    assert "lower lr (now 0.1)" in message and "divergence_factor=0 turns" in message


@pytest.mark.parametrize(
    "compression, momentum, hint",
    [
        # momentum correction diverged on random-k too (0.10): no momentum at all
        ("randomk:0.01+ef:reset=5,momentum=0.9", 0.0, "compression='randomk:0.01+ef:reset=5'"),
        ("topk:0.01+ef", 0.9, "compression='topk:0.01+ef:momentum=0.9' with optimizer"),
        ("sign:chunk=32+ef:reset=5", 0.5, "'sign:chunk=32+ef:reset=5,momentum=0.5' with"),
    ],
)
def test_each_compressor_gets_its_own_remedy(compression: str, momentum: float, hint: str):
    cfg = TrainConfig(
        compression=compression, optimizer_kwargs={"momentum": momentum}, optimizer="sgd"
    )
    with pytest.raises(DivergedError) as err:
        check_loss_growth(_history([2.0, 1.0]), 500.0, 2, cfg)
    assert hint in str(err.value)


@pytest.mark.parametrize(
    "compression, momentum",
    [("none", 0.9), ("randomk:0.01+ef", 0.0), ("topk:0.01+ef:momentum=0.9", 0.0), ("fp16", 0.9)],
)
def test_the_compressor_remedy_appears_only_where_it_applies(compression: str, momentum: float):
    cfg = TrainConfig(
        compression=compression, optimizer_kwargs={"momentum": momentum}, optimizer="sgd"
    )
    with pytest.raises(DivergedError) as err:
        check_loss_growth(_history([2.0, 1.0]), 500.0, 2, cfg)
    assert "momentum correction" not in str(err.value)
    assert "lower lr" in str(err.value) and "StandardScaler" in str(err.value)


def test_the_floor_is_named_when_it_sets_the_reference():
    cfg = TrainConfig(compression={"0.*": "topk:0.01+ef:reset=5", "*": "fp16"})
    cfg.optimizer_kwargs["momentum"] = 0.5
    with pytest.raises(DivergedError) as err:
        check_loss_growth(_history([2.0, 0.01]), 30.0, 2, cfg)
    assert "30x 1 (0.5 x epoch 1's mean 2;" in str(err.value)
    assert "compression='topk:0.01+ef:reset=5,momentum=0.5'" in str(err.value)  # the table's


@pytest.mark.parametrize("value", [1, 0.5, -1, float("nan"), True, "100"])
def test_bad_factors_are_refused(value: Any):
    with pytest.raises(
        ConfigError, match="divergence_factor=.* must be 0 \\(off\\) or a number > 1"
    ):
        TrainConfig(divergence_factor=value)


def _growing_spec(**config: Any) -> Any:
    # SGD at lr 10 with momentum 0.9 on random labels: the cross-entropy grows about
    # 10-100x an epoch and stays finite for 8 epochs (9.7, 71, 6517, 1.1e5, ...)
    return loop_spec(
        lr=10.0, optimizer="sgd", optimizer_kwargs={"momentum": 0.9}, batch_size=8, **config
    )


@pytest.mark.parametrize("strategy", ["ring", "tree"])
def test_a_growing_loss_stops_every_rank_at_the_same_epoch(strategy: str):
    spec = _growing_spec(epochs=5, strategy=strategy)
    parts = random_parts([40, 40])

    def rank_fn(rank: int, coll: Any) -> Any:
        try:
            return run_partition(worker_context(rank, 2, coll, spec), parts[rank])
        except Exception as exc:  # compared below, rank by rank
            return exc

    outcomes = run_ranks(2, rank_fn, timeout=60)
    assert all(isinstance(o, DivergedError) for o in outcomes), outcomes
    assert str(outcomes[0]) == str(outcomes[1])
    assert str(outcomes[0]).startswith("epoch 3: the mean training loss is")


def test_without_the_guard_the_same_run_ends_silently():
    """What the run did before the guard: five finite epochs, the loss 1e6x the first."""
    result = train_and_assemble(
        _growing_spec(epochs=5, divergence_factor=0), random_parts([40, 40])
    )
    losses = [r["loss"] for r in result.history]
    assert len(losses) == 5 and losses[-1] > 1e5 * losses[0]
