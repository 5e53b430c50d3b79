"""Compressed ring/tree training in threads (no Spark): replicas stay bitwise in sync,
the weighting rule survives, and the byte figures are honest."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from sparktrain.compress import build
from sparktrain.compress.collective import CompressedAllreduce, path_for
from sparktrain.config import TrainConfig
from sparktrain.driver.job import check_job
from sparktrain.errors import CommError, ConfigError
from sparktrain.result import assemble as _assemble
from sparktrain.wire import make_allreduce
from sparktrain.wire.ring import ring_raw_bytes_sent

from .fixtures import (
    assert_close_params,
    loop_spec,
    raise_first,
    random_parts,
    run_mesh_ranks,
    sgd_reference,
    train_and_assemble,
    train_in_threads,
)

pytestmark = pytest.mark.timeout(300)

TRAIN_SPECS = [
    "fp16",
    "bf16",
    "int8+ef",
    "int8:chunk=16,stochastic",
    "topk:0.3+ef",
    "topk:0.3,sampled+ef",
    "randomk:0.5+ef",
    "sign+ef",
    "powersgd:1+ef",
]


def _stats(outputs) -> list[dict]:
    return [json.loads(r.data) for out in outputs for r in out if r.kind == "stats"]


@pytest.mark.parametrize("strategy", ["ring", "tree"])
@pytest.mark.parametrize("sizes", [[13, 6], [9, 0, 11]])
@pytest.mark.parametrize("spec", TRAIN_SPECS)
def test_compressed_training_keeps_replicas_bitwise_in_sync(strategy, sizes, spec):
    # tiny buckets: several per step, so buckets without the count slot are covered too
    cfg = dict(strategy=strategy, num_workers=len(sizes), compression=spec, bucket_mb=1e-4)
    spec_ = loop_spec(**cfg, batch_size=4, epochs=2, shuffle=True)
    outputs = train_in_threads(spec_, random_parts(sizes))
    stats = _stats(outputs)
    assert len({s["param_digest"] for s in stats}) == 1
    comp = build(spec)
    assert comp is not None
    assert {s["compression_path"] for s in stats} == {path_for(comp, len(sizes), strategy)}
    records = [r for out in outputs for r in out]
    result = _assemble(spec_.model_fn(), records, spec_.config, wall_s=1.0, stage_s=1.0)
    assert result.summary["replicas_in_sync"]
    assert np.isfinite(result.summary["final_loss"])


@pytest.mark.parametrize("strategy", ["ring", "tree"])
def test_fp16_full_batch_matches_single_process_training(strategy):
    """The weighting rule survives compression: uneven and empty partitions, full-batch
    steps, fp16 -> the single-process result up to fp16 rounding."""
    sizes = [7, 3, 0]
    spec = loop_spec(strategy=strategy, num_workers=3, compression="fp16")
    parts = random_parts(sizes)
    result = train_and_assemble(spec, parts)
    assert_close_params(result.model, sgd_reference(spec, parts), 5e-3)


def test_count_slot_is_exact_through_every_path():
    """N comes back exactly (it never goes through the compressor) even where the
    compressor would mangle it: sign/bf16 cannot represent 12345 exactly."""
    world = 3
    counts = [12345.0, 0.0, 7.0]

    def body(rank: int, mesh):
        out = {}
        for spec in ("sign", "bf16", "topk:0.01"):
            comp = build(spec)
            assert comp is not None
            for algo in ("ring", "tree"):
                red = CompressedAllreduce(comp, make_allreduce(algo, mesh))
                grads = torch.ones(100)
                out[spec, algo] = red.reduce_(0, grads, counts[rank], raw_length=101)
        return out

    results = run_mesh_ranks(world, body)
    raise_first(results)
    for res in results:
        assert set(res.values()) == {12352.0}


def test_byte_accounting_topk_allgather():
    """raw = what the plain ring would have sent; wire = compressed frames; top-k at 1%
    with int32 indices is 50x on the payload, and the all-gather grows with the world."""
    n = 100_000

    def body(rank: int, mesh):
        comp = build("topk:0.01")
        assert comp is not None
        red = CompressedAllreduce(comp, make_allreduce("ring", mesh))
        before = mesh.stats.as_dict()
        red.reduce_(0, torch.randn(n), 1.0, raw_length=n + 1)
        after = mesh.stats.as_dict()
        return {k: after[k] - before[k] for k in after}

    for world in (2, 3):
        results = run_mesh_ranks(world, body)
        raise_first(results)
        for rank, d in enumerate(results):
            assert d["raw_bytes_sent"] == ring_raw_bytes_sent(n + 1, world, rank, 4)
            payload = 1000 * 8
            assert (world - 1) * payload < d["wire_bytes_sent"] < (world - 1) * (payload + 400)


def test_malformed_peer_payload_fails_every_rank_without_hanging():
    """A rank that sends garbage makes every rank raise a CommError (no hang)."""

    class Garbage:
        spec = "garbage"
        summable = False

        def __init__(self, inner):
            self.inner = inner

        def compress(self, tensor, state):
            payload, ctx = self.inner.compress(tensor, state)
            return (payload[0], payload[1][:-1]), ctx  # int8 with a missing scale

        def decompress(self, payload, ctx):
            return self.inner.decompress(payload, ctx)

        def add_into(self, out, payload, ctx):
            self.inner.add_into(out, payload, ctx)

        def payload_nbytes(self, numel):
            return self.inner.payload_nbytes(numel)

    def body(rank: int, mesh):
        comp = build("int8")
        if rank == 1:
            comp = Garbage(comp)
        red = CompressedAllreduce(comp, make_allreduce("ring", mesh))  # type: ignore[arg-type]
        red.reduce_(0, torch.randn(5000), 1.0)

    results = run_mesh_ranks(3, body, timeout=10.0, join_timeout=60.0)
    assert all(isinstance(r, CommError) for r in results), results


def test_delta_is_refused_on_ring_and_tree():
    with pytest.raises(ConfigError, match="drop 'delta"):
        check_job(TrainConfig(compression="delta+int8"))
