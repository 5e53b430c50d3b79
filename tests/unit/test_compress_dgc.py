"""Deep Gradient Compression's remedies for top-k, each switched on its own: momentum
factor masking (``+ef:momentum=M,mask=0|1``), local gradient clipping
(``+ef:local_clip=C``), sparsity warm-up (``topk:R,warmup=S``), their spec grammar, and
exact resume of their state from a checkpoint."""

from __future__ import annotations

import io
import itertools
import math

import numpy as np
import pytest
import torch

from sparktrain.compress.base import BucketState, decode_message, encode_message
from sparktrain.compress.feedback import (
    CLIP_STEPS,
    CLIPPED,
    MOMENTUM,
    RESIDUAL,
    SCALE,
    WORLD,
    ErrorFeedback,
    clip_fraction,
)
from sparktrain.compress.registry import build
from sparktrain.compress.snapshot import dump_state, dump_states, load_state, load_states
from sparktrain.compress.topk import TopK, keep_count
from sparktrain.config import TrainConfig
from sparktrain.driver.job import check_job
from sparktrain.errors import ConfigError


def _x(n: int, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).standard_normal(n).astype(np.float32))


def _ef(spec: str) -> ErrorFeedback:
    comp = build(spec)
    assert isinstance(comp, ErrorFeedback)
    return comp


# ---------------------------------------------------------------------- momentum masking
def test_masking_zeroes_momentum_at_sent_coordinates_only_when_on():
    g1, g2 = _x(1000, 1), _x(1000, 2)
    runs = {}
    for spec in ("topk:0.1+ef:momentum=0.9", "topk:0.1+ef:momentum=0.9,mask=0"):
        comp = _ef(spec)
        state = BucketState()
        sent1 = comp.decompress(*comp.compress(g1, state))
        u1 = state.slots[MOMENTUM].clone()
        sent2 = comp.decompress(*comp.compress(g2, state))
        runs[comp.mask] = (sent1, u1, sent2, state.slots[MOMENTUM].clone())
    (on1, u_on, on2, u_on2), (off1, u_off, off2, u_off2) = runs[True], runs[False]
    # step 1: the same input and residual, so the same coordinates go out
    assert torch.equal(on1, off1)
    hit = on1 != 0
    assert int(hit.sum()) == 100
    assert torch.all(u_on[hit] == 0) and torch.equal(u_on[~hit], g1[~hit])
    assert torch.equal(u_off, g1)  # unmasked: the momentum is the gradient itself
    # step 2: u = 0.9 u + g with the masked or the whole momentum
    torch.testing.assert_close(u_off2, 0.9 * g1 + g2, rtol=0, atol=0)
    assert not torch.equal(on2, off2)  # masking changed what goes out next
    expect_on = 0.9 * u_on + g2
    assert torch.all(u_on2[on2 != 0] == 0)
    torch.testing.assert_close(u_on2[on2 == 0], expect_on[on2 == 0], rtol=0, atol=0)


def test_mask_defaults_and_dense_refusal():
    assert _ef("topk:0.01+ef:momentum=0.9").mask is True
    assert _ef("randomk:0.01+ef:momentum=0.9").mask is True
    assert _ef("sign:chunk=32+ef:momentum=0.9").mask is False
    assert _ef("sign:chunk=32+ef:momentum=0.9,mask=0").mask is False
    with pytest.raises(ConfigError, match="mask=1 needs a sparse compressor"):
        build("int8+ef:momentum=0.9,mask=1")
    with pytest.raises(ConfigError, match="only applies with momentum"):
        build("topk:0.01+ef:mask=0")


# ---------------------------------------------------------------------- local clipping
@pytest.mark.parametrize("world", [1, 4, 9])
def test_local_clip_bounds_what_enters_the_accumulation(world):
    g = _x(500, 3) * 2.0  # per-sample gradient, norm about 45
    n_r = 8.0  # the input is n_r g, as the ring sends it
    c = 3.0
    limit = c / math.sqrt(world)
    comp = _ef(f"topk:0.1+ef:momentum=0.9,mask=0,local_clip={c:g}")
    state = BucketState(slots={SCALE: n_r, WORLD: float(world)})
    inp = g * n_r
    before = inp.clone()
    comp.compress(inp, state)
    assert torch.equal(inp, before)  # the caller's gradient is not touched
    u = state.slots[MOMENTUM]  # unmasked: exactly the clipped per-sample gradient
    assert float(u.norm()) == pytest.approx(limit, rel=1e-5)
    torch.testing.assert_close(u, g * (limit / float(g.norm())))
    # without momentum: sent / n_r + residual (per sample) is the clipped gradient
    plain = _ef(f"topk:0.1+ef:local_clip={c:g}")
    st = BucketState(slots={SCALE: n_r, WORLD: float(world)})
    sent = plain.decompress(*plain.compress(inp, st))
    assert float((sent / n_r + st.slots[RESIDUAL]).norm()) == pytest.approx(limit, rel=1e-5)
    assert (st.slots[CLIP_STEPS], st.slots[CLIPPED], clip_fraction(st)) == (1, 1, 1.0)


def test_local_clip_is_inactive_under_the_threshold():
    g = _x(500, 4)
    norm = float(g.norm())
    outs = {}
    for spec in (
        "topk:0.05+ef:momentum=0.9",
        f"topk:0.05+ef:momentum=0.9,local_clip={norm * 1.01}",
    ):
        comp = _ef(spec)
        state = BucketState(slots={SCALE: 1.0})  # no world slot: world 1
        sent = [comp.decompress(*comp.compress(g * (0.5 + 0.5 * (i % 2)), state)) for i in range(4)]
        outs[spec] = (sent, state.slots[RESIDUAL], state.slots[MOMENTUM])
    a, b = outs.values()
    for x, y in zip(a[0], b[0], strict=True):
        assert torch.equal(x, y)
    assert torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])
    # at world 4 the same C clips: the bound is C / 2
    comp = _ef(f"topk:0.05+ef:local_clip={norm * 1.01}")
    state = BucketState(slots={SCALE: 1.0, WORLD: 4.0})
    comp.compress(g, state)
    comp.compress(g * 0.1, state)  # norm 0.1 |g| < 0.505 |g|: not clipped
    assert clip_fraction(state) == 0.5


def test_ring_reducer_tells_the_compressor_its_world():
    """CompressedAllreduce sets ``ef.world`` next to ``ef.scale``: at world 2 the clip
    bound is C / sqrt(2), so a gradient of norm C/1.2 is clipped there."""
    from sparktrain.compress.collective import CompressedAllreduce
    from sparktrain.wire import make_allreduce

    from .fixtures import raise_first, run_mesh_ranks

    g = _x(400, 5)
    c = float(g.norm()) * 1.2

    def body(rank: int, mesh):
        red = CompressedAllreduce(_ef(f"topk:0.1+ef:local_clip={c}"), make_allreduce("ring", mesh))
        red.reduce_(0, g.clone(), 1.0)
        st = red.states[0]
        return st.slots[WORLD], clip_fraction(st)

    results = run_mesh_ranks(2, body)
    raise_first(results)
    assert results == [(2.0, 1.0), (2.0, 1.0)]


# ---------------------------------------------------------------------- sparsity warm-up
def test_warmup_ratio_sequence_exact():
    comp = TopK(0.01, warmup=10)
    n = 1000
    x = _x(n, 6)
    # 0.25 ** (1 - t/10) * 0.01 ** (t/10): 25 % at t=0, 5 % at t=5 (geometric mean)
    assert comp.ratio_at(0) == 0.25
    assert comp.ratio_at(5) == pytest.approx(0.05)
    assert comp.ratio_at(10) == comp.ratio_at(1000) == 0.01
    ratios = [comp.ratio_at(t) for t in range(11)]
    assert all(a > b for a, b in itertools.pairwise(ratios))
    ks = []
    for t in range(13):
        payload, ctx = comp.compress(x, BucketState(step=t))
        ks.append(payload[0].size)
        out = comp.decompress(payload, ctx)  # the receiver takes whatever k came
        idx = np.flatnonzero(out.numpy())
        assert idx.size == payload[0].size
        np.testing.assert_array_equal(out.numpy()[idx], x.numpy()[idx])
        # the kept ones are the largest
        assert np.abs(x.numpy()[idx]).min() >= np.sort(np.abs(x.numpy()))[-idx.size]
    assert ks == [250, 182, 132, 96, 69, 50, 37, 27, 20, 14, 10, 10, 10]  # ceil of the above
    assert comp.payload_nbytes(n) == TopK(0.01).payload_nbytes(n) == 10 * 6  # steady state


def test_warmup_never_below_the_target_ratio():
    comp = TopK(0.5, warmup=4)  # above the 25 % start: no warm-up effect
    assert [comp.ratio_at(t) for t in range(6)] == [0.5] * 6


def test_warmup_sampled_variant_and_decode_of_varying_k():
    n = 200_000  # large enough that the sampled threshold path is taken
    comp = TopK(0.01, sampled=True, warmup=8)
    x = _x(n, 7)
    acc = torch.zeros(n)
    want = torch.zeros(n)
    for t in range(10):
        k = keep_count(comp.ratio_at(t), n)
        payload, ctx = comp.compress(x, BucketState(step=t, seed=3))
        got = payload[0].size
        if 4 * k >= n:  # a quarter or more: the exact top-k
            assert got == k
        else:  # sampled threshold: about k, trimmed to 1.25 k
            assert 0.5 * k <= got <= math.ceil(1.25 * k), (t, k, got)
        blob = encode_message(payload, ctx, 1.0)
        part, part_ctx, _ = decode_message(blob, n)
        comp.add_into(acc, part, part_ctx)
        want += comp.decompress(payload, ctx)
    assert torch.equal(acc, want)
    assert keep_count(comp.ratio_at(0), n) == 50_000 and keep_count(comp.ratio_at(9), n) == 2000


# ---------------------------------------------------------------------- spec grammar
@pytest.mark.parametrize(
    "spec, printed",
    [
        ("topk:0.01+ef:momentum=0.9", "topk:0.01+ef:momentum=0.9"),  # as before this change
        ("topk:0.01+ef", "topk:0.01+ef"),
        ("sign:chunk=32+ef:momentum=0.9", "sign:chunk=32+ef:momentum=0.9"),
        ("topk:0.01+ef:momentum=0.9,mask=1", "topk:0.01+ef:momentum=0.9"),
        ("topk:0.01+ef:mask=0,momentum=0.9", "topk:0.01+ef:momentum=0.9,mask=0"),
        ("sign+ef:momentum=0.9,mask=0", "sign+ef:momentum=0.9"),
        ("topk:0.01+ef:local_clip=2.5,reset=7", "topk:0.01+ef:reset=7,local_clip=2.5"),
        ("topk:0.01+ef:local_clip=0.123456789", "topk:0.01+ef:local_clip=0.123456789"),
        ("topk:0.01,warmup=0+ef", "topk:0.01+ef"),
        ("topk:ratio=0.01,warmup=200+ef", "topk:0.01,warmup=200+ef"),
        ("topk:0.01,warmup=50,sampled+ef", "topk:0.01,sampled,warmup=50+ef"),
        (
            "topk:0.01,warmup=200+ef:local_clip=1,mask=0,momentum=0.9",
            "topk:0.01,warmup=200+ef:momentum=0.9,mask=0,local_clip=1",
        ),
    ],
)
def test_spec_round_trips(spec, printed):
    comp = build(spec)
    assert comp is not None and comp.spec == printed
    again = build(printed)
    assert again is not None and again.spec == printed


@pytest.mark.parametrize(
    "spec, message",
    [
        ("topk:0.01+ef:momentum=0.9,mask=2", "mask=2 must be 0"),
        ("topk:0.01+ef:momentum=0.9,mask=yes", "is not an integer"),
        ("topk:0.01+ef:momentum=0.9,mask=-1", ">= 0"),
        ("int8+ef:momentum=0.9,mask=1", "sparse compressor"),
        ("topk:0.01+ef:mask=1", "only applies with momentum"),
        ("topk:0.01+ef:local_clip=-1", "local_clip=-1 must be in"),
        ("topk:0.01+ef:local_clip=0", "local_clip=0 must be in"),
        ("topk:0.01+ef:local_clip=abc", "is not a number"),
        ("topk:0.01+ef:local_clip=inf", "finite"),
        ("topk:0.01+ef:local_clip=nan", "must be in"),
        ("topk:0.01,local_clip=1", "write it after \\+ef"),
        ("topk:0.01,mask=0+ef:momentum=0.9", "write it after \\+ef"),
        ("topk:0.01,warmup=-1+ef", "warmup=-1 must be >= 0"),
        ("topk:0.01,warmup=1.5+ef", "is not an integer"),
        ("topk:0.01,warmup=abc+ef", "is not an integer"),
        ("topk:0.01+ef:warmup=10", "unknown option 'warmup'"),
    ],
)
def test_spec_errors(spec, message):
    with pytest.raises(ConfigError, match=message):
        build(spec)


def test_config_still_refuses_optimizer_momentum_with_momentum_correction():
    for spec in ("topk:0.01+ef:momentum=0.9,mask=0", "topk:0.01,warmup=5+ef:momentum=0.9"):
        with pytest.raises(ConfigError, match="optimizer_kwargs.momentum=0"):
            TrainConfig(
                compression=spec, optimizer_kwargs={"momentum": 0.9}, optimizer="sgd"
            ).validate()
        TrainConfig(
            compression=spec, optimizer_kwargs={"momentum": 0.0}, optimizer="sgd"
        ).validate()
    # clipping and warm-up alone leave the optimizer's momentum alone
    TrainConfig(
        compression="topk:0.01,warmup=5+ef:local_clip=1",
        optimizer_kwargs={"momentum": 0.9},
        optimizer="sgd",
    ).validate()


# ---------------------------------------------------------------------- checkpoints
def _roundtrip_state(state: BucketState) -> BucketState:
    buf = io.BytesIO()
    torch.save(dump_state(state), buf)
    buf.seek(0)
    return load_state(torch.load(buf, weights_only=True))


@pytest.mark.parametrize("sampled", ["", ",sampled"])
def test_resume_mid_warmup_is_bitwise_exact(sampled):
    """All remedies on; save mid-warm-up, load into a fresh compressor and state, and
    continue: every payload equals the uninterrupted run's."""
    n = 120_000
    spec = f"topk:0.01{sampled},warmup=6+ef:momentum=0.9,mask=0,local_clip=1000"
    # norm about sqrt(n) = 346, every third step 4x that; the bound is 1000 / sqrt(4)
    grads = [_x(n, 100 + t) * (1.0 + 3.0 * (t % 3 == 0)) for t in range(10)]

    def step(comp, state, t):
        state.slots[SCALE], state.slots[WORLD] = float(4 + t % 2), 4.0
        payload, _ctx = comp.compress(grads[t] * state.slots[SCALE], state)
        state.step += 1
        return payload

    comp = build(spec)
    state = BucketState(key=1, seed=9)
    ref = [step(comp, state, t) for t in range(10)]
    assert 0.0 < clip_fraction(state) < 1.0  # the clip was exercised both ways

    comp = build(spec)
    state = BucketState(key=1, seed=9)
    for t in range(4):
        step(comp, state, t)
    fresh, resumed = build(spec), _roundtrip_state(state)
    for t in range(4, 10):
        got = step(fresh, resumed, t)
        for a, b in zip(got, ref[t], strict=True):
            np.testing.assert_array_equal(a, b)
    assert resumed.slots[CLIP_STEPS] == 10


def test_resume_through_the_reducer_states_at_world_2():
    """The collective's per-bucket states (with ``ef.world`` and the clip counters)
    saved mid-warm-up and loaded into a second reducer continue bit for bit."""
    from sparktrain.compress.collective import CompressedAllreduce
    from sparktrain.wire import make_allreduce

    from .fixtures import raise_first, run_mesh_ranks

    spec = "topk:0.02,warmup=4+ef:momentum=0.9,local_clip=200"  # |g| ~ 55, 1150 at t=1
    n = 3000

    def body(rank: int, mesh):
        algo = make_allreduce("ring", mesh)
        red = CompressedAllreduce(build(spec), algo)
        grads = [_x(n, 10 * rank + t) * (1 + 20 * (t == 1)) for t in range(7)]
        for t in range(3):
            red.reduce_(0, grads[t] * (t + 1), float(t + 1))
        buf = io.BytesIO()
        torch.save(dump_states(red.states), buf)
        buf.seek(0)
        twin = CompressedAllreduce(build(spec), algo)
        twin.states = load_states(torch.load(buf, weights_only=True))
        same = []
        for t in range(3, 7):
            a, b = grads[t] * (t + 1), grads[t] * (t + 1)
            red.reduce_(0, a, float(t + 1))
            twin.reduce_(0, b, float(t + 1))
            same.append(torch.equal(a, b))
        return same, twin.states[0].slots[WORLD], clip_fraction(twin.states[0])

    results = run_mesh_ranks(2, body)
    raise_first(results)
    for same, world, frac in results:
        assert same == [True] * 4
        assert world == 2.0 and frac is not None and 0.0 < frac < 1.0


def test_tree_aggregate_round_tells_the_compressor_its_partitions():
    """A treeAggregate round sets ``ef.world`` to the number of partitions it sums
    (``RoundSpec.partitions``), next to ``ef.scale``."""
    import dataclasses

    from sparktrain.strategies.tree_aggregate.flat import flatten
    from sparktrain.strategies.tree_aggregate.task import _STATES, partition_round

    from .fixtures import rounds_blocks, rounds_cfg, rounds_model, rounds_spec

    _STATES.clear()
    try:
        cfg = rounds_cfg(compression="topk:0.2+ef:local_clip=1e-3")  # always clips
        blocks = rounds_blocks((37, 20))
        model = rounds_model()
        spec = dataclasses.replace(rounds_spec(cfg, model, blocks, "dgc-world"), partitions=2)
        weights = flatten(list(model.parameters()))
        for b in blocks:
            partition_round(spec, weights, b, 0)
        states = _STATES["dgc-world"].comp_states
        for b in blocks:
            st = states[b.index][0]
            assert st.slots[WORLD] == 2.0 and st.slots[SCALE] == 8.0
            assert clip_fraction(st) == 1.0
    finally:
        _STATES.clear()


def test_sign_without_drop_last_warns_what_to_set(caplog: pytest.LogCaptureFixture) -> None:
    from sparktrain.config import TrainConfig

    spec = "sign:chunk=32+ef:momentum=0.9"
    kw = {"compression": spec, "optimizer": "sgd", "optimizer_kwargs": {"momentum": 0.0}}
    with caplog.at_level("WARNING", logger="sparktrain.strategies.base"):
        check_job(TrainConfig(**kw))
    assert any("drop_last=true" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING", logger="sparktrain.strategies.base"):
        check_job(TrainConfig(**kw, drop_last=True))
        check_job(TrainConfig(compression="topk:0.01+ef"))
    assert not caplog.records
