"""Compression on the parameter server and on tree_aggregate, without Spark: pushes and
delta pulls through compressors, bit-identical mirrors, honest per-direction bytes,
malformed payloads, the treeAggregate codec's merge, and per-sample error feedback."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from sparktrain.compress.base import BucketState
from sparktrain.compress.feedback import MOMENTUM, RESIDUAL, SCALE
from sparktrain.compress.registry import build
from sparktrain.config import TrainConfig
from sparktrain.driver.job import check_job
from sparktrain.errors import CommError, ConfigError
from sparktrain.strategies.ps import protocol
from sparktrain.strategies.ps.client import shard_shapes
from sparktrain.strategies.tree_aggregate.codec import (
    RAW_BYTES,
    WIRE_BYTES,
    CompressedCodec,
    make_codec,
)
from sparktrain.strategies.tree_aggregate.flat import flatten
from sparktrain.strategies.tree_aggregate.task import _STATES, partition_round

from .fixtures import (
    FakeBlocks,
    FakeContext,
    NoVolume,
    ps_cfg,
    ps_clients,
    ps_server,
    ps_train,
    random_parts,
    rounds_blocks,
    rounds_cfg,
    rounds_model,
    rounds_spec,
)

pytestmark = pytest.mark.timeout(120)


# ---------------------------------------------------------------------- parameter server
@pytest.mark.parametrize("spec", ["fp16", "int8+ef", "topk:0.3+ef", "delta+int8+ef"])
def test_compressed_ps_trains_close_to_uncompressed(spec):
    sizes = [13, 9]
    common = {"ps_shards": 2, "optimizer_kwargs": {"momentum": 0.5}, "epochs": 3}
    base, _, _ = ps_train(ps_cfg(**common), random_parts(sizes))
    got, _, _ = ps_train(ps_cfg(compression=spec, **common), random_parts(sizes))
    s = got.summary
    assert s["replicas_in_sync"] and np.isfinite(s["final_loss"])
    assert s["final_loss"] < base.summary["history"][0]["loss"] + 0.05
    if spec == "fp16":  # near-lossless: the same model up to half-precision rounding
        for a, b in zip(got.model.parameters(), base.model.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)
    # honest figures: raw bytes are what the uncompressed exchange sends, per direction
    ps, ps0 = s["ps"], base.summary["ps"]
    assert ps["push"]["raw_bytes"] == ps0["push"]["raw_bytes"] > 0
    assert ps["pull"]["raw_bytes"] == ps0["pull"]["raw_bytes"] > 0
    assert s["bytes_sent"] == base.summary["bytes_sent"]
    if spec != "topk:0.3+ef":  # top-k at 30 %: values + int32 indices exceed 50 % of raw
        assert ps["push"]["payload_bytes"] < ps0["push"]["payload_bytes"]
    if spec.startswith("delta+"):
        assert ps["pull"]["payload_bytes"] < ps0["pull"]["payload_bytes"]
    else:
        assert ps["pull"]["payload_bytes"] == ps0["pull"]["payload_bytes"]


@pytest.mark.parametrize("spec", ["delta+int8", "delta+topk:0.2+ef", "delta+fp16", "delta+sign"])
def test_delta_pulls_keep_the_mirror_and_the_copy_bit_identical(spec):
    cfg = ps_cfg(compression=spec, ps_shards=2, optimizer_kwargs={"momentum": 0.9}, lr=0.5)
    with ps_server(cfg, world=1) as server:
        clients = ps_clients(server, spec=spec)
        n = server.ranges[-1][1]
        flat = np.zeros(n, np.float32)
        for c in clients:
            assert c.pull(-1, flat[c.lo : c.hi]) == protocol.FULL
        rng = np.random.default_rng(0)
        for step in range(6):
            grad = rng.standard_normal(n).astype(np.float32)
            for c, shard in zip(clients, server.shards, strict=True):
                c.push(step, 4, grad[c.lo : c.hi])
                assert c.pull(step, flat[c.lo : c.hi]) == protocol.CDELTA
                mirror = shard.ranks[0].mirror
                assert mirror is not None
                np.testing.assert_array_equal(flat[c.lo : c.hi], mirror)  # bitwise
        # the copy lags the server by what compression left out, never more than a step
        gap = np.abs(server.parameters() - flat).max()
        assert gap < 0.5 * np.abs(server.parameters()).max()
        for c in clients:
            c.close()


def test_a_malformed_compressed_push_is_refused_not_fatal():
    cfg = ps_cfg(compression="topk:0.5+ef")
    with ps_server(cfg, world=1) as server:
        clients = ps_clients(server, spec=cfg.compression)
        c = clients[0]
        c.pull(-1, np.zeros(c.hi - c.lo, np.float32))
        c.codec.encode = lambda values: np.full(64, 7, np.uint8)  # type: ignore[method-assign]
        with pytest.raises(CommError, match="protocol error.*malformed compressed payload"):
            c.push(0, 3, np.ones(c.hi - c.lo, np.float32))
        assert server.failure is None  # the shard is still serving
        c.close()


def test_ps_compression_specs_are_checked():
    with pytest.raises(ConfigError, match="delta\\+powersgd cannot compress"):
        check_job(TrainConfig(strategy="ps", compression="delta+powersgd:2"))
    check_job(TrainConfig(strategy="ps", compression="delta+int8+ef"))  # fine on the PS
    for strategy in ("ring", "tree"):
        with pytest.raises(ConfigError, match="drop 'delta\\+'"):
            check_job(TrainConfig(strategy=strategy, compression="delta+int8"))
    check_job(TrainConfig(strategy="tree_aggregate", compression="delta+int8+ef"))  # downloads
    with pytest.raises(ConfigError, match="optimizer_kwargs.momentum=0"):
        TrainConfig(
            compression="topk:0.01+ef:momentum=0.9",
            optimizer_kwargs={"momentum": 0.9},
            optimizer="sgd",
        )
    TrainConfig(
        compression="topk:0.01+ef:momentum=0.9", optimizer_kwargs={"momentum": 0.0}, optimizer="sgd"
    )


def test_shard_shapes_keep_whole_parameters_and_cut_the_rest():
    shapes = [(4, 3), (3,), (2, 5)]  # 12 + 3 + 10 = 25 elements
    assert shard_shapes(shapes, 0, 25) == ((4, 3), (3,), (2, 5))
    assert shard_shapes(shapes, 0, 13) == ((4, 3), (1,))
    assert shard_shapes(shapes, 13, 25) == ((2,), (2, 5))
    assert shard_shapes(shapes, 4, 15) == ((2,), (2, 3), (3,))  # whole rows stay a matrix
    assert shard_shapes(shapes, 16, 22) == ((4,), (2,))  # part of row 0, then of row 1
    assert shard_shapes(shapes, 20, 25) == ((1, 5),)
    assert shard_shapes((), 0, 5) == ()
    for lo, hi in [(0, 7), (3, 25), (11, 19)]:
        assert sum(math.prod(s) for s in shard_shapes(shapes, lo, hi)) == hi - lo


# ---------------------------------------------------------------------- error feedback
def test_error_feedback_keeps_its_residual_per_sample():
    """Inputs are n_t g_t with varying n_t: sum_t sent_t / n_t = sum_t g_t - e_T, and a
    step with n_t = 0 keeps the residual for later."""
    comp = build("topk:0.1+ef")
    state = BucketState()
    rng = np.random.default_rng(1)
    counts = [32, 32, 1, 0, 32, 7]
    total_g = torch.zeros(200)
    total_sent = torch.zeros(200)
    for n in counts:
        g = torch.from_numpy(rng.standard_normal(200).astype(np.float32))
        state.slots[SCALE] = float(n)
        payload, ctx = comp.compress(g * n, state)
        sent = comp.decompress(payload, ctx)
        if n:
            total_g += g
            total_sent += sent / n
        else:
            assert not sent.any()
        state.step += 1
    torch.testing.assert_close(total_sent + state.slots[RESIDUAL], total_g, rtol=1e-4, atol=1e-4)


def test_momentum_correction_masks_what_was_sent():
    comp = build("topk:0.25+ef:momentum=0.9")
    state = BucketState()
    g = torch.arange(1.0, 9.0)
    payload, ctx = comp.compress(g, state)
    sent = comp.decompress(payload, ctx)
    assert sent.nonzero().numel() == 2  # the two largest
    assert not state.slots[MOMENTUM][sent != 0].any()
    torch.testing.assert_close(state.slots[MOMENTUM][sent == 0], g[sent == 0])
    # with everything sent the run is plain SGD: momentum cleared every step
    full = build("topk:1.0+ef:momentum=0.9")
    st = BucketState()
    for _ in range(3):
        p, c = full.compress(g, st)
        torch.testing.assert_close(full.decompress(p, c), g)


# ---------------------------------------------------------------------- tree_aggregate
@pytest.mark.parametrize("spec", ["fp16", "bf16", "randomk:0.3", "int8+ef", "topk:0.2", "sign"])
def test_tree_aggregate_codec_merges_like_decode_then_sum(spec):
    codec = make_codec(spec)
    assert isinstance(codec, CompressedCodec)
    rng = np.random.default_rng(0)
    vecs = [rng.standard_normal(300).astype(np.float32) for _ in range(3)]
    blobs = [codec.encode(v, BucketState(step=5)) for v in vecs]  # same seed and step
    want = sum(codec.decode(b).astype(np.float64) for b in blobs)
    merged = codec.merge(codec.merge(blobs[0], blobs[1]), blobs[2])
    got = codec.decode(merged)
    tol = 2e-2 if spec in ("fp16", "bf16") else 1e-5  # summed inside half precision
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    if spec in ("fp16", "bf16", "randomk:0.3"):  # summed still compressed
        assert merged.dtype == np.uint8 and codec.nbytes(merged) == codec.nbytes(blobs[0])
    else:
        assert merged.dtype == np.float32
    assert all(codec.nbytes(b) < vecs[0].nbytes for b in blobs)
    # delta+ is the weight downloads' business: the uploads take the gradient part
    assert make_codec("delta+int8").name == "int8"


def test_tree_aggregate_error_feedback_state_survives_a_retry():
    cfg = rounds_cfg(compression="topk:0.2+ef")
    blocks = rounds_blocks()
    model = rounds_model()
    spec = rounds_spec(cfg, model, blocks, "ef-retry")
    weights = flatten(list(model.parameters()))
    partition_round(spec, weights, blocks[0], 0)
    first = partition_round(spec, weights, blocks[0], 1)
    again = partition_round(spec, weights, blocks[0], 1)  # Spark retried the task
    np.testing.assert_array_equal(first[0], again[0])
    assert first[1][WIRE_BYTES] < first[1][RAW_BYTES]
    _STATES.clear()


@pytest.mark.parametrize("spec", ["fp16", "int8+ef", "topk:0.3+ef", "powersgd:1+ef"])
def test_tree_aggregate_driver_loop_learns_compressed(spec):
    from sparktrain.strategies.tree_aggregate.driver import _Loop
    from sparktrain.strategies.tree_aggregate.driver_round import ClassicBackend, RoundRunner

    cfg = rounds_cfg(epochs=6, lr=0.2, compression=spec)
    blocks = rounds_blocks((90, 70))
    model = rounds_model()
    rspec = rounds_spec(cfg, model, blocks, f"loop-{spec}")
    backend = ClassicBackend(FakeContext(), FakeBlocks(blocks))  # type: ignore[arg-type]
    runner = RoundRunner(backend, rspec)
    loop = _Loop(model, cfg, runner, lambda m: None, NoVolume(), 160, 2, True)  # type: ignore[arg-type]
    loop.train()
    assert loop.history[-1]["loss"] < loop.history[0]["loss"]
    assert loop.wire_bytes > 0
    if spec != "powersgd:1+ef":  # a 6x5 and a 5x3 matrix: rank 1 saves less than the header
        assert loop.wire_bytes < loop.raw_bytes
