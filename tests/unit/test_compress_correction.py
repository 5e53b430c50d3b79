"""Momentum correction by default (issue 34.3): top-k under ``+ef`` takes SGD's momentum
into the compressor (sparktrain/compress/correction.py), and the Nesterov form of
momentum correction (``+ef:momentum=M,nesterov=1``)."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from sparktrain.compress.base import BucketState
from sparktrain.compress.correction import apply_momentum_correction, move_momentum
from sparktrain.compress.feedback import ErrorFeedback
from sparktrain.compress.registry import build
from sparktrain.config import TrainConfig
from sparktrain.errors import ConfigError

MOMENTUM = {"momentum": 0.9}


@pytest.mark.parametrize(
    ("spec", "kwargs", "moved", "left"),
    [
        ("topk:0.01+ef", MOMENTUM, "topk:0.01+ef:momentum=0.9", {"momentum": 0.0}),
        (
            "topk:0.01,sampled + ef:reset=50",
            {"momentum": 0.95, "weight_decay": 1e-4},
            "topk:0.01,sampled+ef:reset=50,momentum=0.95",
            {"momentum": 0.0, "weight_decay": 1e-4},
        ),
        (
            "topk:0.01+ef",
            {"momentum": 0.9, "nesterov": True},
            "topk:0.01+ef:momentum=0.9,nesterov=1",
            {"momentum": 0.0, "nesterov": False},
        ),
        ("delta+topk:0.01+ef", MOMENTUM, "delta+topk:0.01+ef:momentum=0.9", {"momentum": 0.0}),
    ],
)
def test_sparse_ef_under_sgd_momentum_takes_it(spec, kwargs, moved, left):
    move = move_momentum(spec, "sgd", kwargs)
    assert move is not None
    assert move.compression == moved
    assert move.optimizer_kwargs == left
    comp = build(moved)
    assert comp is not None and comp.spec.endswith(moved.rpartition("+")[2].replace(" ", ""))
    # the moved config is one the config accepts (no momentum clash)
    TrainConfig(compression=moved, optimizer_kwargs=left, optimizer="sgd").validate()
    assert "momentum=0" in move.message  # the way back is in the sentence


@pytest.mark.parametrize(
    ("spec", "optimizer", "kwargs", "extra"),
    [
        ("topk:0.01+ef:momentum=0", "sgd", MOMENTUM, {}),  # the opt-out: kept as it is
        ("topk:0.01", "sgd", MOMENTUM, {}),  # no +ef: nothing to correct into
        ("int8+ef", "sgd", MOMENTUM, {}),  # dense: not a sparsifier
        ("randomk:0.01+ef", "sgd", MOMENTUM, {}),  # diverges with momentum of either kind
        ("powersgd:2+ef", "sgd", MOMENTUM, {}),
        ("none", "sgd", MOMENTUM, {}),
        ("auto", "sgd", MOMENTUM, {}),
        ({"*": "topk:0.01+ef"}, "sgd", MOMENTUM, {}),  # a table: unmatched would lose it
        ("topk:0.01+ef", "adam", {}, {}),
        ("topk:0.01+ef", "sgd", {}, {}),  # no momentum to move
        ("topk:0.01+ef", "sgd", {"momentum": 0.9, "dampening": 0.1}, {}),
        ("topk:0.01+ef", "sgd", MOMENTUM, {"lr_schedule_kwargs": {"cycle_momentum": True}}),
        ("topk:0.01+ef", "sgd", MOMENTUM, {"local_steps": 4}),  # FedAvg deltas
    ],
)
def test_everything_else_keeps_todays_behaviour(spec, optimizer, kwargs, extra):
    assert move_momentum(spec, optimizer, kwargs, **extra) is None


def test_both_explicit_is_still_the_clash_error():
    with pytest.raises(ConfigError, match="optimizer_kwargs.momentum=0"):
        TrainConfig(
            compression="topk:0.01+ef:momentum=0.9", optimizer_kwargs=MOMENTUM, optimizer="sgd"
        )


def test_the_config_is_copied_and_the_move_said_once(caplog: pytest.LogCaptureFixture) -> None:
    cfg = TrainConfig(
        compression="topk:0.01+ef", optimizer_kwargs={"momentum": 0.9}, optimizer="sgd"
    )
    with caplog.at_level(logging.WARNING, logger="sparktrain.compress.correction"):
        moved = apply_momentum_correction(cfg)
    assert moved is not cfg
    assert (cfg.compression, cfg.optimizer_kwargs) == ("topk:0.01+ef", {"momentum": 0.9})
    assert moved.compression == "topk:0.01+ef:momentum=0.9"
    assert moved.optimizer_kwargs == {"momentum": 0.0}
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "moves into the compressor" in said[0]
    assert "'topk:0.01+ef:momentum=0'" in said[0]
    # nothing to move: the same object, nothing said
    caplog.clear()
    plain = TrainConfig(compression="int8+ef", optimizer_kwargs={"momentum": 0.9}, optimizer="sgd")
    assert apply_momentum_correction(plain) is plain
    assert apply_momentum_correction(moved) is moved  # already corrected: no second move
    assert not caplog.records


def _train(spec: str, kwargs: dict[str, float], steps: int = 6) -> torch.Tensor:
    """SGD on a fixed quadratic-ish problem, one rank, the gradient passed through
    ``spec``'s compressor (as the exchange does) before the optimizer steps."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(50))
    opt = torch.optim.SGD([w], lr=0.05, **kwargs)
    comp = build(spec) if spec != "none" else None
    state = BucketState()
    target = torch.linspace(-1, 1, 50)
    for step in range(steps):
        opt.zero_grad()
        loss = ((w - target) ** 2 * torch.arange(1, 51)).sum() + w.sum() * step
        loss.backward()
        assert w.grad is not None
        if comp is not None:
            payload, ctx = comp.compress(w.grad, state)
            w.grad.copy_(comp.decompress(payload, ctx))
            state.step += 1
        opt.step()
    return w.detach().clone()


@pytest.mark.parametrize("nesterov", [False, True])
def test_moved_momentum_is_the_optimizers_when_nothing_is_dropped(nesterov):
    """At ratio 1 (top-k sends everything, so no residual) and without masking the
    move is exact: the compressor's momentum with SGD(momentum=0) steps as SGD's own
    momentum (Nesterov's form too)."""
    kwargs = {"momentum": 0.9, "nesterov": nesterov}
    move = move_momentum("topk:1.0+ef", "sgd", kwargs)
    assert move is not None
    spec = move.compression.replace("momentum=0.9", "momentum=0.9,mask=0")
    optimizers = _train("none", kwargs)
    corrected = _train(spec, move.optimizer_kwargs)
    torch.testing.assert_close(corrected, optimizers, rtol=1e-5, atol=1e-6)
    # and it differs from plain SGD: the momentum did move, it was not dropped
    assert not torch.allclose(_train("none", {}), optimizers, atol=1e-3)


def test_nesterov_spec_grammar():
    comp = build("topk:0.01+ef:nesterov=1,momentum=0.9")
    assert isinstance(comp, ErrorFeedback) and comp.nesterov
    assert comp.spec == "topk:0.01+ef:momentum=0.9,nesterov=1"
    built = build(comp.spec)
    assert built is not None and built.spec == comp.spec
    assert build("topk:0.01+ef:momentum=0.9,nesterov=0").spec == "topk:0.01+ef:momentum=0.9"  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match="form of momentum correction"):
        build("topk:0.01+ef:nesterov=1")
    with pytest.raises(ConfigError, match="nesterov=2 must be 0"):
        build("topk:0.01+ef:momentum=0.9,nesterov=2")


def test_a_checkpoint_from_before_the_move_says_how_to_resume() -> None:
    from sparktrain.compress.collective import CompressedAllreduce

    red = CompressedAllreduce.__new__(CompressedAllreduce)  # only its spec is asked
    for saved, keep in (
        ("topk:0.01+ef", "topk:0.01+ef:momentum=0"),
        ("topk:0.01+ef:reset=5", "topk:0.01+ef:reset=5,momentum=0"),
    ):
        red.comp = build(saved.replace("+ef", "+ef:momentum=0.9", 1).replace("0.9:", "0.9,"))
        with pytest.raises(ConfigError, match=re.escape(f"compression='{keep}' keeps it in")):
            red.load_state_dict({"spec": saved, "count": 1.0, "buckets": []})
    red.comp = build("int8+ef")
    with pytest.raises(ConfigError, match="resume with the same compression$"):
        red.load_state_dict({"spec": "fp16", "count": 1.0, "buckets": []})
