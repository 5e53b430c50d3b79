"""The loop's helpers: learning-rate schedule with warm-up, mixed precision, early stopping.

Small real models (``nn.Linear``) and real optimizers; no Spark.
"""

from __future__ import annotations

import io
import json
import math
from typing import Any

import pytest
import torch
from torch import nn

from sparktrain.config import TrainConfig
from sparktrain.errors import ConfigError
from sparktrain.task.early_stop import EarlyStopping, default_mode
from sparktrain.task.lr_schedule import LrSchedule
from sparktrain.task.precision import Precision

LR = 0.1
CPU = torch.device("cpu")


# ---------------------------------------------------------------------- helpers
def _model() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(4, 2)


def _optimizer(model: nn.Module, kind: str = "sgd") -> torch.optim.Optimizer:
    if kind == "adam":
        return torch.optim.Adam(model.parameters(), lr=LR)
    return torch.optim.SGD(model.parameters(), lr=LR)


def _schedule(
    steps_per_epoch: int = 4, epochs: int = 3, kind: str = "sgd", **cfg: Any
) -> tuple[nn.Linear, torch.optim.Optimizer, LrSchedule]:
    model = _model()
    opt = _optimizer(model, kind)
    config = TrainConfig(lr=LR, **cfg)
    return model, opt, LrSchedule(opt, config, steps_per_epoch=steps_per_epoch, epochs=epochs)


def _train_step(model: nn.Linear, opt: torch.optim.Optimizer) -> None:
    x = torch.randn(8, 4)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def _run(
    model: nn.Linear,
    opt: torch.optim.Optimizer,
    sched: LrSchedule,
    epochs: int,
    steps_per_epoch: int,
    records: list[dict[str, float]] | None = None,
    start_epoch: int = 0,
) -> list[float]:
    """The rate every optimizer step actually used (read from the group inside the step),
    checking that ``sched.lr`` announced it beforehand."""
    used: list[float] = []
    for epoch in range(start_epoch, epochs):
        for _ in range(steps_per_epoch):
            announced = sched.lr
            sched.before_step()
            used.append(opt.param_groups[0]["lr"])
            assert announced == used[-1]
            _train_step(model, opt)
            sched.after_step()
        sched.after_epoch(records[epoch] if records else {"loss": 1.0})
    return used


def _cosine(k: int, t_max: int, base: float = LR, eta_min: float = 0.0) -> float:
    return eta_min + (base - eta_min) * (1 + math.cos(math.pi * k / t_max)) / 2


def _torch_reference(make: Any, steps: int, kind: str = "sgd") -> list[float]:
    """Rates a plain torch scheduler gives, stepped after every optimizer step."""
    model = _model()
    opt = _optimizer(model, kind)
    sched = make(opt)
    used = []
    for _ in range(steps):
        used.append(opt.param_groups[0]["lr"])
        _train_step(model, opt)
        sched.step()
    return used


# ---------------------------------------------------------------------- schedules
def test_no_schedule_is_a_constant_rate_and_still_saves_state() -> None:
    model, opt, sched = _schedule()
    assert _run(model, opt, sched, 3, 4) == [LR] * 12
    state = sched.state_dict()
    assert state["step"] == 12 and state["scheduler"] is None
    _, _, fresh = _schedule()
    fresh.load_state_dict(state)
    assert fresh.steps == 12 and fresh.lr == LR


def test_cosine_per_step_spans_the_run_and_matches_torch() -> None:
    model, opt, sched = _schedule(lr_schedule="CosineAnnealingLR")
    used = _run(model, opt, sched, 3, 4)
    assert used == pytest.approx([_cosine(k, 12) for k in range(12)], rel=1e-12)
    reference = _torch_reference(lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, 12), 12)
    assert used == reference  # bitwise: the same scheduler, undisturbed


def test_cosine_per_step_starts_after_the_warm_up() -> None:
    model, opt, sched = _schedule(lr_schedule="CosineAnnealingLR", warmup_steps=3)
    used = _run(model, opt, sched, 3, 4)
    # warm-up ramps to the schedule's first rate; cosine then runs its whole curve over
    # the remaining 9 steps (T_max = 12 - 3)
    expected = [LR * 1 / 3, LR * 2 / 3, LR] + [_cosine(k, 9) for k in range(9)]
    assert used == pytest.approx(expected, rel=1e-12)
    reference = _torch_reference(lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, 9), 9)
    assert used[3:] == reference  # the warm-up left the chainable scheduler undisturbed


def test_warm_up_alone_ramps_linearly() -> None:
    model, opt, sched = _schedule(warmup_steps=4)
    used = _run(model, opt, sched, 2, 3)
    assert used == pytest.approx([LR / 4, LR / 2, LR * 3 / 4, LR, LR, LR], rel=1e-15)
    assert opt.param_groups[0]["lr"] == LR  # the factor never outlives a step


def test_cosine_per_epoch_with_and_without_warm_up() -> None:
    model, opt, sched = _schedule(
        steps_per_epoch=3, epochs=4, lr_schedule="CosineAnnealingLR", lr_schedule_interval="epoch"
    )
    used = _run(model, opt, sched, 4, 3)
    per_epoch = [_cosine(e, 4) for e in range(4)]  # T_max defaults to the epochs
    assert used == pytest.approx([r for r in per_epoch for _ in range(3)], rel=1e-12)

    model, opt, sched = _schedule(
        steps_per_epoch=3,
        epochs=4,
        lr_schedule="CosineAnnealingLR",
        lr_schedule_interval="epoch",
        warmup_steps=2,
    )
    warmed = _run(model, opt, sched, 4, 3)
    assert warmed[:2] == pytest.approx([LR / 2, LR], rel=1e-15)
    assert warmed[2:] == pytest.approx(used[2:], rel=1e-12)


def test_step_lr_per_epoch() -> None:
    model, opt, sched = _schedule(
        steps_per_epoch=2,
        epochs=5,
        lr_schedule="StepLR",
        lr_schedule_kwargs={"step_size": 2, "gamma": 0.5},
        lr_schedule_interval="epoch",
    )
    used = _run(model, opt, sched, 5, 2)
    per_epoch = [LR, LR, LR / 2, LR / 2, LR / 4]
    assert used == pytest.approx([r for r in per_epoch for _ in range(2)], rel=1e-15)


def test_linear_lr_defaults_to_the_run() -> None:
    model, opt, sched = _schedule(
        steps_per_epoch=5, epochs=2, lr_schedule="LinearLR", lr_schedule_kwargs={"end_factor": 0.0}
    )
    used = _run(model, opt, sched, 2, 5)
    # torch's start_factor 1/3, down to 0 over the run's 10 steps
    expected = [LR / 3 * (1 - k / 10) for k in range(10)]
    assert used == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_one_cycle_defaults_span_the_run_up_to_the_configured_lr(kind: str) -> None:
    model, opt, sched = _schedule(steps_per_epoch=5, epochs=2, kind=kind, lr_schedule="OneCycleLR")
    used = _run(model, opt, sched, 2, 5)
    # plain SGD has no momentum to cycle; Adam's betas are cycled as torch does by default
    reference = _torch_reference(
        lambda o: torch.optim.lr_scheduler.OneCycleLR(
            o, max_lr=LR, total_steps=10, cycle_momentum=kind == "adam"
        ),
        10,
        kind,
    )
    assert used == reference
    assert used[0] == pytest.approx(LR / 25) and max(used) == pytest.approx(LR)
    assert opt.param_groups[0].get("momentum", 0.0) == 0.0  # SGD: not switched on


def test_reduce_on_plateau_watches_the_monitored_key() -> None:
    kwargs = {"monitor": "val_loss", "patience": 0, "factor": 0.5}
    records = [{"val_loss": v, "loss": 0.0} for v in (1.0, 0.8, 0.9, 0.95, 0.7)]
    model, opt, sched = _schedule(
        steps_per_epoch=1,
        epochs=5,
        lr_schedule="ReduceLROnPlateau",
        lr_schedule_kwargs=kwargs,
        lr_schedule_interval="epoch",
    )
    used = _run(model, opt, sched, 5, 1, records)
    assert used == pytest.approx([LR, LR, LR, LR / 2, LR / 4], rel=1e-15)
    assert sched.monitor == "val_loss"


def test_reduce_on_plateau_infers_max_mode_for_accuracy() -> None:
    model, opt, sched = _schedule(
        steps_per_epoch=1,
        epochs=3,
        lr_schedule="ReduceLROnPlateau",
        lr_schedule_kwargs={"monitor": "accuracy", "patience": 0, "factor": 0.5},
        lr_schedule_interval="epoch",
    )
    records = [{"accuracy": v} for v in (0.5, 0.6, 0.7)]
    assert _run(model, opt, sched, 3, 1, records) == [LR, LR, LR]  # rising: no cut


def test_reduce_on_plateau_errors() -> None:
    with pytest.raises(ConfigError, match="lr_schedule_interval='epoch'"):
        _schedule(lr_schedule="ReduceLROnPlateau", lr_schedule_interval="step")
    _, _, sched = _schedule(lr_schedule="ReduceLROnPlateau", lr_schedule_interval="epoch")
    with pytest.raises(ConfigError, match=r"monitors 'loss'.*it has: accuracy, val_loss"):
        sched.after_epoch({"val_loss": 1.0, "accuracy": 0.5})


def test_bad_kwargs_name_the_schedule_the_kwargs_and_torchs_message() -> None:
    with pytest.raises(ConfigError) as err:
        _schedule(lr_schedule="StepLR", lr_schedule_kwargs={"step_sz": 2})
    text = str(err.value)
    assert "lr_schedule='StepLR'" in text
    assert "{'step_sz': 2}" in text
    assert "unexpected keyword argument 'step_sz'" in text
    with pytest.raises(ConfigError, match=r"'LinearLR'.*\{'start_factor': 2\}.*factor"):
        _schedule(lr_schedule="LinearLR", lr_schedule_kwargs={"start_factor": 2})  # ValueError


RESUMABLE: list[dict[str, Any]] = [
    {"lr_schedule": "CosineAnnealingLR", "warmup_steps": 8},
    {"lr_schedule": "CosineAnnealingLR", "warmup_steps": 2},
    {"lr_schedule": "OneCycleLR", "warmup_steps": 1},
    {
        "lr_schedule": "StepLR",
        "lr_schedule_kwargs": {"step_size": 1, "gamma": 0.7},
        "lr_schedule_interval": "epoch",
        "warmup_steps": 3,
    },
    {
        "lr_schedule": "ReduceLROnPlateau",
        "lr_schedule_kwargs": {"patience": 0, "factor": 0.5},
        "lr_schedule_interval": "epoch",
    },
]


@pytest.mark.parametrize(
    "cfg", RESUMABLE, ids=lambda c: f"{c['lr_schedule']}-{c.get('warmup_steps', 0)}"
)
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_a_resumed_schedule_continues_bitwise(cfg: dict[str, Any], kind: str) -> None:
    records = [{"loss": v} for v in (1.0, 1.1, 0.9, 1.2, 1.3)]
    model, opt, sched = _schedule(steps_per_epoch=3, epochs=5, kind=kind, **cfg)
    whole = _run(model, opt, sched, 5, 3, records)

    model, opt, sched = _schedule(steps_per_epoch=3, epochs=5, kind=kind, **cfg)
    head = _run(model, opt, sched, 2, 3, records)  # stop after epoch 2 (6 steps: mid warm-up at 8)
    buffer = io.BytesIO()
    torch.save(sched.state_dict(), buffer)  # as a checkpoint would
    buffer.seek(0)

    model, opt, resumed = _schedule(steps_per_epoch=3, epochs=5, kind=kind, **cfg)
    resumed.load_state_dict(torch.load(buffer, weights_only=False))
    tail = _run(model, opt, resumed, 5, 3, records, start_epoch=2)
    assert head + tail == whole


def test_a_state_of_another_schedule_is_refused() -> None:
    _, _, cosine = _schedule(lr_schedule="CosineAnnealingLR")
    _, _, step = _schedule(lr_schedule="StepLR", lr_schedule_kwargs={"step_size": 1})
    with pytest.raises(ConfigError, match="cannot continue as another"):
        step.load_state_dict(cosine.state_dict())


# ---------------------------------------------------------------------- precision
def _loss(model: nn.Linear, precision: Precision) -> torch.Tensor:
    torch.manual_seed(1)
    x = torch.randn(8, 4)
    with precision.autocast():
        out = model(x)
    return out.float().pow(2).mean()


def test_fp32_is_a_no_op() -> None:
    precision = Precision("fp32", CPU)
    model = _model()
    opt = _optimizer(model)
    loss = _loss(model, precision)
    assert model(torch.randn(1, 4)).dtype == torch.float32
    assert precision.scale(loss) is loss
    loss.backward()
    before = model.weight.grad.clone()
    precision.unscale_(opt)
    assert torch.equal(model.weight.grad, before)
    assert precision.step(opt) is True
    assert precision.describe() == {
        "precision": "fp32",
        "autocast_dtype": None,
        "skipped_steps": 0,
        "loss_scale": None,
    }
    fresh = Precision("fp32", CPU)
    fresh.load_state_dict(precision.state_dict())
    assert fresh.describe() == precision.describe()


def test_bf16_autocasts_matmuls_to_bfloat16_on_cpu() -> None:
    precision = Precision("bf16", CPU)
    model = _model()
    with precision.autocast():
        out = model(torch.randn(3, 4))
    assert out.dtype == torch.bfloat16
    assert model.weight.dtype == torch.float32  # parameters stay float32
    loss = out.float().sum()
    assert precision.scale(loss) is loss
    assert precision.describe()["autocast_dtype"] == "bfloat16"


def test_fp16_runs_on_cpu_and_unscales_to_the_true_gradients() -> None:
    precision = Precision("fp16", CPU)
    model = _model()
    with precision.autocast():
        assert model(torch.randn(3, 4)).dtype == torch.float16
    # without autocast the only difference is the scale, a power of two: exact
    reference = _model()
    reference(torch.ones(2, 4)).sum().backward()
    opt = _optimizer(model)
    precision.scale(model(torch.ones(2, 4)).sum()).backward()
    assert not torch.equal(model.weight.grad, reference.weight.grad)  # still scaled
    precision.unscale_(opt)
    assert torch.equal(model.weight.grad, reference.weight.grad)
    assert precision.step(opt) is True


def test_fp16_skips_a_step_with_an_inf_gradient() -> None:
    precision = Precision("fp16", CPU)
    model = _model()
    opt = _optimizer(model)
    scale = precision.loss_scale
    precision.scale(model(torch.ones(2, 4)).sum()).backward()
    model.weight.grad[0, 0] = float("inf")  # as an overflow would leave it
    weights = model.weight.detach().clone()
    assert precision.step(opt) is False
    assert torch.equal(model.weight, weights)  # the step was skipped
    assert precision.skipped_steps == 1
    assert precision.loss_scale == scale / 2

    opt.zero_grad()
    precision.scale(model(torch.ones(2, 4)).sum()).backward()
    assert precision.step(opt) is True
    assert not torch.equal(model.weight, weights)
    assert precision.skipped_steps == 1
    assert precision.describe() == {
        "precision": "fp16",
        "autocast_dtype": "float16",
        "skipped_steps": 1,
        "loss_scale": scale / 2,
    }

    # a resumed run keeps the scale and the count
    fresh = Precision("fp16", CPU)
    fresh.load_state_dict(precision.state_dict())
    assert fresh.loss_scale == scale / 2 and fresh.skipped_steps == 1


def test_non_finite_losses_fp16_tolerates_a_streak_up_to_the_limit() -> None:
    precision = Precision("fp16", CPU, skip_limit=3)
    nan, inf = float("nan"), float("inf")
    assert [precision.loss_is_finite(v) for v in (nan, inf, 1.0)] == [True, True, True]
    # the finite loss reset the streak: the third in a row is the limit
    assert [precision.loss_is_finite(v) for v in (nan, -inf, nan)] == [True, True, False]
    assert Precision("fp16", CPU, skip_limit=1).loss_is_finite(nan) is False


@pytest.mark.parametrize("name", ["fp32", "bf16"])
def test_non_finite_losses_stop_fp32_and_bf16_at_once(name: str) -> None:
    precision = Precision(name, CPU, skip_limit=5)
    assert precision.loss_is_finite(0.5) is True
    assert precision.loss_is_finite(float("nan")) is False


def test_unknown_precision_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="allowed values: fp32, bf16, fp16"):
        Precision("fp8", CPU)


# ---------------------------------------------------------------------- early stopping
def _feed(stopper: EarlyStopping, values: list[float], key: str) -> list[bool]:
    return [stopper.update({key: v, "epoch": i}) for i, v in enumerate(values)]


def test_default_mode_follows_the_metric_name() -> None:
    assert [default_mode(n) for n in ("loss", "val_rmse", "MAE", "error_rate")] == ["min"] * 4
    assert [default_mode(n) for n in ("accuracy", "macro_f1", "auc", "r2")] == ["max"] * 4


def test_min_mode_stops_after_patience_records_without_improvement() -> None:
    stopper = EarlyStopping({"metric": "loss", "patience": 2})
    assert stopper.mode == "min" and stopper.active
    stops = _feed(stopper, [1.0, 0.9, 0.95, 0.91], "loss")
    assert stops == [False, False, False, True]
    assert (stopper.best, stopper.best_index, stopper.stopped_at) == (0.9, 1, 3)
    assert stopper.update({"loss": 0.1}) is True  # a stopped run stays stopped


def test_max_mode_and_improved_flag() -> None:
    stopper = EarlyStopping({"metric": "accuracy", "patience": 1})
    assert stopper.mode == "max"
    flags = []
    for value in (0.5, 0.7, 0.6):
        stopper.update({"accuracy": value})
        flags.append(stopper.improved)
    assert flags == [True, True, False]
    assert stopper.stopped_at == 2 and stopper.best == 0.7


def test_explicit_mode_wins_over_the_name() -> None:
    stopper = EarlyStopping({"metric": "loss", "mode": "max", "patience": 1})
    assert _feed(stopper, [1.0, 2.0, 1.5], "loss") == [False, False, True]


def test_min_delta_must_be_exceeded() -> None:
    stopper = EarlyStopping({"metric": "auc", "patience": 2, "min_delta": 0.05})
    stops = _feed(stopper, [0.5, 0.54, 0.56, 0.6, 0.61], "auc")
    # 0.54 is within min_delta of 0.5; 0.56 beats it; 0.6 is within 0.05 of 0.56, 0.61 too
    assert stops == [False, False, False, False, True]
    assert (stopper.best, stopper.best_index) == (0.56, 2)

    low = EarlyStopping({"metric": "loss", "patience": 1, "min_delta": 0.1})
    assert _feed(low, [1.0, 0.95], "loss") == [False, True]


def test_nan_counts_as_no_improvement() -> None:
    stopper = EarlyStopping({"metric": "loss", "patience": 2})
    assert _feed(stopper, [float("nan"), 1.0, float("nan"), float("inf")], "loss") == [
        False,
        False,
        False,
        True,
    ]
    assert (stopper.best, stopper.best_index) == (1.0, 1)


def test_a_missing_metric_lists_the_records_numeric_keys() -> None:
    stopper = EarlyStopping({"metric": "val_accuracy"})
    with pytest.raises(ConfigError, match=r"'val_accuracy' is missing.*: accuracy, loss\."):
        stopper.update({"loss": 0.3, "accuracy": 0.9, "phase": "train", "done": True})


def test_an_empty_table_is_inactive() -> None:
    stopper = EarlyStopping({})
    assert not stopper.active
    assert not any(stopper.update({}) for _ in range(10))


def test_early_stopping_state_round_trips_through_json() -> None:
    table = {"metric": "loss", "patience": 3, "min_delta": 0.01, "restore_best": True}
    values = [1.0, 0.8, 0.85, float("nan"), 0.79, 0.9, 0.95]
    whole = EarlyStopping(table)
    expected = _feed(whole, values, "loss")

    head = EarlyStopping(table)
    first = _feed(head, values[:3], "loss")
    resumed = EarlyStopping(table)
    resumed.load_state_dict(json.loads(json.dumps(head.state_dict())))
    assert first + _feed(resumed, values[3:], "loss") == expected
    assert resumed.state_dict() == whole.state_dict()
    assert resumed.restore_best and resumed.best_index == 1

    other = EarlyStopping({"metric": "accuracy"})
    other.load_state_dict(head.state_dict())  # another metric's state says nothing here
    assert other.best is None
