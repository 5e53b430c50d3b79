"""The link probe over a thread mesh on loopback, the compute measurements and the
auto resolution every rank must agree on."""

from __future__ import annotations

import dataclasses
import threading
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from sparktrain.builders import build_loss
from sparktrain.config import TrainConfig
from sparktrain.errors import ConfigError
from sparktrain.task import probe
from sparktrain.task.context import JobSpec, WorkerContext
from sparktrain.task.probe import (
    measure_compressors,
    probe_links,
    resolve_auto,
    time_compute,
)
from sparktrain.wire.tree import tree_raw_bytes_sent

from .fixtures import SECRET, raise_first, run_mesh_ranks


def _same_but_timing(estimates):  # type: ignore[no-untyped-def]
    return {dataclasses.replace(e, probe_s=0.0) for e in estimates}


class _Ticks:
    """A stand-in for the probe's clock: each thread's readings go 1, 2, 3... ``tick``."""

    def __init__(self, tick: float) -> None:
        self.tick = tick
        self._count = threading.local()

    def perf_counter(self) -> float:
        self._count.n = getattr(self._count, "n", 0) + 1
        return self._count.n * self.tick


@pytest.mark.parametrize("world", [2, 3])
def test_probe_derives_its_figures_as_documented_and_every_rank_agrees(world, monkeypatch):
    """On a clock that ticks once per reading in each rank's thread, every lap and every
    transfer lasts one tick, so the figures are exact: alpha the median lap per hop, beta
    the fastest transfer less alpha (at least half of it) per byte, the slowest rank's
    compute time; the same on every rank. And the probe is bounded: each rank sends its
    laps' tokens, its transfers and one tiny tree allreduce, nothing more."""
    tick = 2.0**-10
    monkeypatch.setattr(probe, "time", SimpleNamespace(perf_counter=_Ticks(tick).perf_counter))

    def body(rank, mesh):
        return probe_links(mesh, compute_s=0.001 * (rank + 1)), mesh.stats.raw_bytes_sent

    results = run_mesh_ranks(world, body, timeout=10.0)
    raise_first(results)
    estimates = [est for est, _ in results]
    assert len(_same_but_timing(estimates)) == 1
    est = estimates[0]
    assert est.world == world
    assert est.alpha_s == pytest.approx(tick / world)
    transfer = max(tick - tick / world, tick / 2)
    assert est.beta_s_per_byte == pytest.approx(transfer / probe.DEFAULT_TRANSFER_BYTES)
    assert est.compute_s == pytest.approx(0.001 * world)  # the slowest rank's
    assert est.probe_s > 0
    figures = 3  # alpha, transfer, compute: no compressors
    for rank, (_, sent) in enumerate(results):
        laps = probe.DEFAULT_PINGS + 1  # one token per lap, the warm-up's included
        transfers = probe.DEFAULT_TRANSFERS * (1 + probe.DEFAULT_TRANSFER_BYTES)
        assert sent == laps + transfers + tree_raw_bytes_sent(figures, world, rank, 8)


def test_probe_of_one_worker_sends_nothing():
    results = run_mesh_ranks(1, lambda rank, mesh: (probe_links(mesh), mesh.stats.wire_bytes_sent))
    raise_first(results)
    est, sent = results[0]
    assert (est.alpha_s, est.beta_s_per_byte, sent) == (0.0, 0.0, 0)


def test_probe_refuses_bad_arguments():
    results = run_mesh_ranks(2, lambda rank, mesh: probe_links(mesh, rank=1 - rank))
    assert all(isinstance(r, ConfigError) for r in results)


def test_compressor_measurements():
    shapes = [(64, 128), (128,)]
    got = {
        c.spec: c
        for c in measure_compressors(
            ["fp16", "int8+ef", "topk:0.01+ef", "powersgd:2+ef"], 64 * 128 + 128, shapes
        )
    }
    assert got["fp16"].summable and got["fp16"].ratio == pytest.approx(2.0)
    assert got["fp16"].calls == 1
    assert got["powersgd:2+ef"].summable and got["powersgd:2+ef"].calls == 2  # P, then Q
    assert got["powersgd:2+ef"].ratio > 10
    assert not got["topk:0.01+ef"].summable and got["topk:0.01+ef"].ratio > 20
    assert not got["int8+ef"].summable and 3 < got["int8+ef"].ratio < 4
    for c in got.values():
        assert c.fixed_s_per_elem > 0
    assert got["int8+ef"].per_peer_s_per_elem > 0


def test_time_compute_leaves_the_model_as_it_was():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 3))
    before = [p.detach().clone() for p in model.parameters()]
    x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
    rng = torch.get_rng_state()
    t = time_compute(model, build_loss("cross_entropy", {}), x, y)
    assert t > 0
    assert model.training
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert torch.equal(rng, torch.get_rng_state())
    assert time_compute(model, build_loss("cross_entropy", {}), x[:0], y[:0]) == 0.0


def _ctx(rank: int, world: int, **cfg) -> WorkerContext:  # type: ignore[no-untyped-def]
    spec = JobSpec(
        job_id="test-job",
        attempt=0,
        secret=SECRET,
        config=TrainConfig(**cfg),
        model_fn=None,
        model_kwargs={},
        feature_width=8,
        num_outputs=3,
    )
    return WorkerContext(rank, world, "127.0.0.1", lambda m: [m], lambda: None, spec)


def _resolve(world: int, **cfg):  # type: ignore[no-untyped-def]
    def body(rank, mesh):  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 128), nn.ReLU(), nn.Linear(128, 3))
        x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))
        ctx, auto = resolve_auto(
            _ctx(rank, world, **cfg), mesh, model, build_loss("cross_entropy", {}), x, y
        )
        return ctx.job.config, auto

    results = run_mesh_ranks(world, body, timeout=10.0)
    raise_first(results)
    return results


def test_resolve_auto_gives_every_rank_the_same_choice():
    results = _resolve(2, strategy="auto", compression="auto")
    configs = {(c.strategy, c.compression) for c, _ in results}
    assert len(configs) == 1
    strategy, compression = configs.pop()
    assert strategy in ("ring", "tree")
    # a 1539-parameter model on loopback: nothing to gain from compressing
    assert compression == "none"
    auto = results[0][1]
    assert auto["asked"] == {"strategy": "auto", "compression": "auto"}
    assert auto["strategy"] == strategy and auto["reason"]
    assert auto["probe"]["alpha_s"] > 0
    assert {"ring/none", "tree/topk:0.01+ef"} <= set(auto["candidates"])
    assert results[0][1]["candidates"] == results[1][1]["candidates"]


def test_resolve_auto_chooses_only_what_is_auto():
    for c, _ in _resolve(2, strategy="ring", compression="auto"):
        assert c.strategy == "ring"
    for c, auto in _resolve(2, strategy="auto", compression="fp16"):
        assert c.compression == "fp16" and c.strategy in ("ring", "tree")
        assert set(auto["candidates"]) == {"ring/fp16", "tree/fp16"}
    for c, auto in _resolve(2, strategy="tree", compression="none"):
        assert (c.strategy, auto) == ("tree", None)
