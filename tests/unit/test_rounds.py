"""tree_aggregate's pieces without Spark: flat vectors, the combOp's merge math, one
partition's gradient / local-SGD delta against torch references, and the driver loop over
an in-process stand-in for the cached RDD."""

from __future__ import annotations

import copy
import functools
from typing import Any

import numpy as np
import pytest
import torch

from sparktrain import TrainConfig
from sparktrain.driver.job import check_job
from sparktrain.strategies.tree_aggregate.codec import (
    COMPUTE_S,
    EVAL_ROWS,
    LOSS_SUM,
    NUM_STATS,
    RAW_BYTES,
    SAMPLES,
    WIRE_BYTES,
    CompressedCodec,
    Contribution,
    IdentityCodec,
    make_codec,
    merge,
)
from sparktrain.strategies.tree_aggregate.driver import _Loop
from sparktrain.strategies.tree_aggregate.driver_round import ClassicBackend, RoundRunner
from sparktrain.strategies.tree_aggregate.flat import assign, assign_grads, flatten, flatten_grads
from sparktrain.strategies.tree_aggregate.task import _STATES, Block, RoundSpec, partition_round

from .fixtures import (
    ROUNDS_MODEL_FN,
    ROUNDS_WIDTH,
    FakeBlocks,
    FakeContext,
    NoVolume,
    rounds_blocks,
    rounds_cfg,
    rounds_model,
    rounds_spec,
)


def _batch_indices(cfg: TrainConfig, block: Block, epoch: int) -> list[np.ndarray]:
    rng = np.random.default_rng([cfg.seed, block.index, epoch])
    order = rng.permutation(block.train.size)
    return [order[s : s + cfg.batch_size] for s in range(0, block.train.size, cfg.batch_size)]


# ------------------------------------------------------------------ flat vectors
def test_flatten_and_assign_round_trip() -> None:
    model = rounds_model()
    params = list(model.parameters())
    vec = flatten(params)
    assert vec.dtype == np.float32 and vec.size == sum(p.numel() for p in params)
    expected = np.concatenate([p.detach().numpy().ravel() for p in params])
    np.testing.assert_array_equal(vec, expected)
    other = list(rounds_model(seed=1).parameters())
    assign(other, vec)
    for a, b in zip(params, other, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(ValueError, match="flat vector has 3 values"):
        assign(other, np.zeros(3, np.float32))


def test_grads_round_trip_and_missing_grads_are_zero() -> None:
    params = list(rounds_model().parameters())
    params[0].grad = torch.ones_like(params[0])
    vec = flatten_grads(params)
    n0 = params[0].numel()
    assert (vec[:n0] == 1).all() and (vec[n0:] == 0).all()
    vec[:] = np.arange(vec.size, dtype=np.float32)
    assign_grads(params, vec)
    np.testing.assert_array_equal(flatten_grads(params), vec)


# ------------------------------------------------------------------ merge (combOp)
def test_merge_sums_payloads_and_stats_in_any_tree_order() -> None:
    rng = np.random.default_rng(0)
    codec = IdentityCodec()
    parts: list[Contribution] = []
    for _ in range(7):
        stats = rng.random(NUM_STATS)
        parts.append((rng.standard_normal(11).astype(np.float32), stats))
    ref_vec = np.sum([p[0] for p in parts], axis=0, dtype=np.float64)
    ref_stats = np.sum([p[1] for p in parts], axis=0)
    ref_stats[COMPUTE_S] = max(p[1][COMPUTE_S] for p in parts)

    def fresh() -> list[Contribution]:  # merge reuses its first argument
        return [(v.copy(), s.copy()) for v, s in parts]

    left = functools.reduce(lambda a, b: merge(a, b, codec), fresh(), None)
    p = fresh()  # a depth-2 tree: ((0 1 2) (3 4) (5 6)), with a None zero in between
    level = [
        merge(merge(merge(None, p[0], codec), p[1], codec), p[2], codec),
        merge(p[3], p[4], codec),
        merge(p[5], merge(p[6], None, codec), codec),
    ]
    tree = merge(merge(level[0], level[1], codec), level[2], codec)
    for got in (left, tree):
        assert got is not None
        np.testing.assert_allclose(got[0], ref_vec, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(got[1], ref_stats, rtol=1e-12)
    # an evaluation-only contribution has no payload
    only_stats = merge((None, np.ones(NUM_STATS)), (None, np.ones(NUM_STATS)), codec)
    assert only_stats is not None and only_stats[0] is None and only_stats[1][0] == 2


# ------------------------------------------------------------------ one partition's round
def test_synchronous_round_is_the_gradient_of_the_global_mean_loss() -> None:
    cfg = rounds_cfg()
    blocks = rounds_blocks((37, 20))  # 20 rows: partition 1 runs out after 3 batches
    model = rounds_model()
    spec = rounds_spec(cfg, model, blocks, "sync")
    weights = flatten(list(model.parameters()))
    codec = spec.codec
    for round_index in (0, 3, 4 + 5):  # epoch 0 rounds 0 and 3 (p1 empty), epoch 1 round 4
        parts = [partition_round(spec, weights, b, round_index) for b in blocks]
        total = functools.reduce(lambda a, b: merge(a, b, codec), parts, None)
        assert total is not None
        vec, stats = codec.decode(total[0]), total[1]
        # reference: one torch backward over the union of the round's batches
        epoch, r = divmod(round_index, spec.rounds_per_epoch)
        xs, ys = [], []
        for b in blocks:
            batches = _batch_indices(cfg, b, epoch)
            if r < len(batches):
                xs.append(b.train.x[batches[r]])
                ys.append(b.train.y[batches[r]])
        x, y = torch.from_numpy(np.concatenate(xs)), torch.from_numpy(np.concatenate(ys)).long()
        ref_model = copy.deepcopy(model)
        loss = torch.nn.functional.cross_entropy(ref_model(x), y)
        loss.backward()
        ref = flatten_grads(list(ref_model.parameters()))
        assert stats[SAMPLES] == len(y)
        np.testing.assert_allclose(vec / stats[SAMPLES], ref, rtol=1e-5, atol=1e-6)
        assert stats[LOSS_SUM] / stats[SAMPLES] == pytest.approx(loss.item(), rel=1e-5)
        assert stats[RAW_BYTES] == stats[WIRE_BYTES] == 4 * vec.size * len(xs)


def test_local_sgd_round_averages_deltas_weighted_by_samples() -> None:
    cfg = rounds_cfg(local_steps=3, optimizer_kwargs={"momentum": 0.9})
    blocks = rounds_blocks((37, 20))
    model = rounds_model()
    spec = rounds_spec(cfg, model, blocks, "local")
    assert spec.rounds_per_epoch == 2  # ceil(37 / 24)
    weights = flatten(list(model.parameters()))
    round_index = 1  # partition 0: batches 3..4 (8 + 5 rows); partition 1: none left
    parts = [partition_round(spec, weights, b, round_index) for b in blocks]
    deltas, counts = [], []
    for b in blocks:  # reference: k SGD steps on a copy, with fresh momentum
        ref = copy.deepcopy(model)
        opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        n = 0
        for idx in _batch_indices(cfg, b, 0)[3:6]:
            opt.zero_grad()
            out = ref(torch.from_numpy(b.train.x[idx]))
            torch.nn.functional.cross_entropy(
                out, torch.from_numpy(b.train.y[idx]).long()
            ).backward()
            opt.step()
            n += len(idx)
        deltas.append(flatten(list(ref.parameters())) - weights)
        counts.append(n)
    assert counts == [13, 0]
    assert parts[1][0] is None and parts[1][1][SAMPLES] == 0  # ran out: sends nothing
    payload, stats = parts[0]
    assert stats[SAMPLES] == 13
    np.testing.assert_allclose(payload, deltas[0] * 13, rtol=1e-5, atol=1e-6)
    total = functools.reduce(lambda a, b: merge(a, b, spec.codec), parts, None)
    assert total is not None
    expected = sum(d * n for d, n in zip(deltas, counts, strict=True)) / sum(counts)
    np.testing.assert_allclose(total[0] / total[1][SAMPLES], expected, rtol=1e-5, atol=1e-6)


def test_a_recomputed_round_is_identical() -> None:
    """What Spark's task retry relies on: same inputs, same contribution, whatever ran
    in this Python worker before (the model cache is only a cache)."""
    cfg = rounds_cfg(local_steps=2, optimizer="adam", optimizer_kwargs={})
    blocks = rounds_blocks()
    model = rounds_model()
    spec = rounds_spec(cfg, model, blocks, "retry")
    weights = flatten(list(model.parameters()))
    first = partition_round(spec, weights, blocks[0], 1, evaluate_first=True)
    partition_round(spec, weights + 1, blocks[1], 0)  # disturb the cached model
    _STATES.clear()
    again = partition_round(spec, weights, blocks[0], 1, evaluate_first=True)
    np.testing.assert_array_equal(first[0], again[0])
    np.testing.assert_array_equal(first[1][:COMPUTE_S], again[1][:COMPUTE_S])
    assert first[1][EVAL_ROWS] == 10


def test_task_hook_runs_first() -> None:
    seen: list[tuple[int, int]] = []
    cfg = rounds_cfg()
    blocks = rounds_blocks()
    model = rounds_model()
    spec = rounds_spec(cfg, model, blocks, "hook")
    spec = RoundSpec(**{**spec.__dict__, "task_hook": lambda p, r: seen.append((p, r))})
    partition_round(spec, flatten(list(model.parameters())), blocks[1], 2)
    assert seen == [(1, 2)]


# ------------------------------------------------------------------ the driver loop
@pytest.mark.parametrize("local_steps", [1, 4])
@pytest.mark.parametrize("in_closure", [True, False])
def test_driver_loop_learns_and_reports(local_steps: int, in_closure: bool) -> None:
    cfg = rounds_cfg(epochs=6, local_steps=local_steps, lr=0.2)
    blocks = rounds_blocks((90, 70))
    model = rounds_model()
    spec = rounds_spec(cfg, model, blocks, f"loop{local_steps}")
    sc = FakeContext()
    # small weights ride in the task closure; closure_max_bytes=0 forces a broadcast
    limit = 1 << 20 if in_closure else 0
    backend = ClassicBackend(sc, FakeBlocks(blocks), closure_max_bytes=limit)  # type: ignore[arg-type]
    runner = RoundRunner(backend, spec)
    messages: list[dict[str, Any]] = []
    loop = _Loop(model, cfg, runner, messages.append, NoVolume(), 160, 2, True)  # type: ignore[arg-type]
    loop.train()
    rpe = spec.rounds_per_epoch
    assert runner.rounds == cfg.epochs * rpe + 1
    assert len(sc.handles) == (0 if in_closure else runner.rounds)
    assert all(h.destroyed for h in sc.handles)  # every round's broadcast is released
    kinds = [m["type"] for m in messages]
    assert kinds[0] == "start" and messages[0]["steps_per_epoch"] == rpe
    assert kinds.count("epoch") == cfg.epochs and "step" in kinds
    history = loop.history
    assert [h["epoch"] for h in history] == list(range(cfg.epochs))
    assert history[-1]["loss"] < history[0]["loss"]
    # the last metric is the final model's accuracy on the validation rows
    x = np.concatenate([b.val.x for b in blocks])
    y = np.concatenate([b.val.y for b in blocks])
    with torch.no_grad():
        acc = float((model(torch.from_numpy(x)).argmax(1).numpy() == y).mean())
    assert history[-1]["metric"] == pytest.approx(acc)
    assert history[-1]["metric_name"] == "accuracy"


def test_delta_powersgd_is_refused_on_the_driver() -> None:
    from sparktrain.driver.prepare import PreparedData
    from sparktrain.errors import ConfigError
    from sparktrain.strategies.tree_aggregate.driver import run_rounds

    with pytest.raises(ConfigError, match="delta\\+powersgd cannot compress"):
        check_job(rounds_cfg(compression="delta+powersgd:2+ef"))
    cfg = rounds_cfg()
    cfg.compression = "delta+powersgd:2"  # bypasses validation on purpose
    with pytest.raises(ConfigError, match="delta\\+powersgd cannot compress"):
        run_rounds(
            PreparedData(None, None, ROUNDS_WIDTH),
            rounds_model(),
            cfg,
            model_fn=ROUNDS_MODEL_FN,
            num_outputs=3,
            started=0.0,
        )
    assert isinstance(make_codec("delta+int8+ef"), CompressedCodec)  # uploads: int8+ef


# ------------------------------------------------------------------ compressed downloads
class _ForgetfulBlocks(FakeBlocks):
    """As FakeBlocks, but every ``forget``-th round runs in a "new Python worker": the
    worker-side state (model, mirror) is dropped first, so the task fetches the mirror."""

    def __init__(self, blocks: list[Block], forget: int) -> None:
        super().__init__(blocks)
        self.forget, self.calls = forget, 0

    def treeAggregate(self, zero: Any, seq: Any, comb: Any, depth: int = 2) -> Any:
        self.calls += 1
        if self.forget and self.calls % self.forget == 0:
            _STATES.clear()
        return super().treeAggregate(zero, seq, comb, depth)


def _delta_run(spec_text: str, forget: int) -> tuple[list[dict[str, Any]], _Loop, Any]:
    import secrets

    from sparktrain.strategies.tree_aggregate.codec import download_compressor
    from sparktrain.strategies.tree_aggregate.driver_weights import DownloadEncoder, WeightsServer

    cfg = rounds_cfg(epochs=5, lr=0.2, compression=spec_text)
    blocks = rounds_blocks((90, 70))
    model = rounds_model()
    secret = secrets.token_bytes(32)
    comp = download_compressor(spec_text)
    assert comp is not None
    server = WeightsServer("127.0.0.1", DownloadEncoder(comp, cfg.seed), secret=secret, job_id="dl")
    try:
        spec = rounds_spec(cfg, model, blocks, "dl")
        spec = RoundSpec(
            **{**spec.__dict__, "job_id": "dl", "weights_address": server.address, "secret": secret}
        )
        _STATES.clear()
        backend = ClassicBackend(FakeContext(), _ForgetfulBlocks(blocks, forget))  # type: ignore[arg-type]
        runner = RoundRunner(backend, spec, downloads=server)
        loop = _Loop(model, cfg, runner, lambda m: None, NoVolume(), 160, 2, True)  # type: ignore[arg-type]
        loop.train()
        held = _STATES["dl"].mirror
        return loop.history, loop, (server, held, model)
    finally:
        server.stop()


# no +ef: a "new worker" starts the uploads' residual from zero by design, which would
# make the forgetful run differ for reasons that are not the downloads'
@pytest.mark.parametrize("spec_text", ["delta+int8", "delta+topk:0.1"])
def test_compressed_downloads_learn_and_every_copy_of_the_mirror_is_the_same(
    spec_text: str,
) -> None:
    history, loop, (server, held, model) = _delta_run(spec_text, forget=0)
    assert history[-1]["loss"] < history[0]["loss"]
    assert server.fetches == 0  # the one "worker" always held the previous mirror
    # the final evaluation sent the exact weights: the metric is the driver model's own
    seq, mirror = held
    np.testing.assert_array_equal(mirror, flatten(list(model.parameters())))
    assert seq == loop.runner.rounds - 1
    assert loop.down_wire < 0.6 * loop.down_raw  # the downloads shrank
    # a run in which "new workers" fetch the mirror from the driver is bitwise the same
    again, _, (server2, _, _) = _delta_run(spec_text, forget=3)
    assert server2.fetches > 0
    assert [h["loss"] for h in again] == [h["loss"] for h in history]
    assert [h["metric"] for h in again] == [h["metric"] for h in history]


def test_the_weights_server_serves_only_the_current_mirror_to_the_job() -> None:
    import secrets

    from sparktrain.compress.registry import build
    from sparktrain.errors import CommError, HandshakeError
    from sparktrain.strategies.tree_aggregate.driver_weights import DownloadEncoder, WeightsServer
    from sparktrain.strategies.tree_aggregate.task_weights import fetch_mirror

    comp = build("int8")
    assert comp is not None
    secret = secrets.token_bytes(32)
    server = WeightsServer("127.0.0.1", DownloadEncoder(comp, 0), secret=secret, job_id="j")
    try:
        w = np.arange(10, dtype=np.float32)
        first = server.next(w)
        assert first.message is None and first.seq == 0
        d = server.next(w + 1)
        assert d.message is not None and d.seq == 1
        kw: dict[str, Any] = {"secret": secret, "job_id": "j", "partition": 0, "timeout": 5.0}
        got = fetch_mirror(server.address, seq=1, numel=10, **kw)
        np.testing.assert_array_equal(got, server._encoder.mirror)
        with pytest.raises(CommError, match="mirror 0 is gone"):
            fetch_mirror(server.address, seq=0, numel=10, **kw)
        with pytest.raises(HandshakeError):
            fetch_mirror(server.address, seq=1, numel=10, **{**kw, "job_id": "other"})
    finally:
        server.stop()
