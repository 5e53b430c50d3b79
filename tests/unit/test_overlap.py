"""Overlap of the gradient exchange with backward, and per-layer compression plumbing.

Ranks are threads (no Spark): overlap on must give the very bits of overlap off, for
ring, tree and the parameter server, compressed or not; unused parameters must not
deadlock; a lost peer must surface as the same error type in the training thread.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import threading

import numpy as np
import pytest
import torch
from torch import nn

from sparktrain.config import TrainConfig
from sparktrain.data.partition_data import PartitionData
from sparktrain.errors import CommError, ConfigError, PeerLostError
from sparktrain.result import assemble as _assemble
from sparktrain.strategies.ps.client import check_compression_table
from sparktrain.strategies.ps.server import start_parameter_server
from sparktrain.task.buckets import GradientBuckets, GradientReadiness
from sparktrain.task.context import JobSpec, WorkerContext
from sparktrain.task.faults import FaultPlan
from sparktrain.task.run_task import run_partition
from sparktrain.task.step_sync import OrderedWorker, by_spec
from sparktrain.wire.ring import ring_raw_bytes_sent

from .fixtures import ThreadCollectives, in_threads, random_parts

pytestmark = pytest.mark.timeout(120)

HOST = "127.0.0.1"
SECRET = b"o" * 32


class Net(nn.Module):
    """Three named layers (for per-layer policies) and, optionally, a layer that never
    gets a gradient (for the unused-parameter rule)."""

    def __init__(self, unused: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 16)
        self.fc2 = nn.Linear(16, 16)
        self.fc3 = nn.Linear(16, 3)
        self.spare = nn.Linear(16, 16) if unused else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def _spec(ps_addresses: tuple[str, ...] = (), unused: bool = False, **overrides) -> JobSpec:
    cfg = TrainConfig(
        **{
            "epochs": 2,
            "batch_size": 4,
            "lr": 0.1,
            "shuffle": True,
            "progress": False,
            "comm_timeout": 10.0,
            "bucket_mb": 1e-3,  # several buckets per step
            **overrides,
        }
    )
    return JobSpec(
        job_id="job",
        attempt=0,
        secret=SECRET,
        config=cfg,
        model_fn=functools.partial(Net, unused),
        model_kwargs={},
        feature_width=4,
        num_outputs=3,
        ps_addresses=ps_addresses,
    )


def _run_all(spec: JobSpec, parts: list[PartitionData], timeout: float = 60.0) -> list[object]:
    """Every rank's records, or the exception it raised (no rank's error hides another's)."""
    world = len(parts)
    coll = ThreadCollectives(world, timeout=timeout)
    results: list[object] = [None] * world

    def body(rank: int) -> None:
        ctx = WorkerContext(
            rank, world, HOST, functools.partial(coll.all_gather, rank), coll.barrier, spec
        )
        try:
            results[rank] = run_partition(ctx, parts[rank])
        except BaseException as exc:
            results[rank] = exc

    in_threads(body, range(world), timeout)
    return results


def _train(spec: JobSpec, parts: list[PartitionData]) -> tuple[list[dict], list[object]]:
    """Train; returns every rank's stats and all records (raising the first failure)."""
    server = None
    if spec.config.strategy == "ps":
        torch.manual_seed(spec.config.seed)
        server = start_parameter_server(
            spec.model_fn(), spec.config, host=HOST, secret=SECRET, job_id="job", attempt=0
        )
        spec = dataclasses.replace(spec, ps_addresses=tuple(server.addresses))
    try:
        results = _run_all(spec, parts)
    finally:
        if server is not None:
            server.stop()
    for r in results:
        if isinstance(r, BaseException):
            raise r
    records = [rec for out in results for rec in out]  # type: ignore[attr-defined]
    stats = [json.loads(r.data) for r in records if r.kind == "stats"]
    return stats, records


def _digest(spec: JobSpec, parts: list[PartitionData]) -> str:
    stats, _ = _train(spec, parts)
    digests = {s["param_digest"] for s in stats}
    assert len(digests) == 1, "replicas drifted apart"
    return digests.pop()


# ------------------------------------------------------------ bit-identical results


@pytest.mark.parametrize("strategy", ["ring", "tree"])
@pytest.mark.parametrize(
    "compression",
    ["none", "fp16", "topk:0.3+ef", "powersgd:1+ef", {"fc2.*": "fp16", "*": "sign+ef"}],
)
def test_overlap_gives_the_bits_of_overlap_off(strategy, compression):
    parts = random_parts([13, 6, 0])  # uneven, and one rank without data
    common = dict(strategy=strategy, num_workers=3, compression=compression)
    on_stats, _ = _train(_spec(overlap=True, **common), parts)
    off = _digest(_spec(overlap=False, **common), parts)
    assert {s["param_digest"] for s in on_stats} == {off}
    # ranks with a batch handed their buckets over from the hooks, during backward
    assert on_stats[0]["buckets"] > 1
    assert on_stats[0]["buckets_launched_in_backward"] > 0
    assert on_stats[2]["buckets_launched_in_backward"] == 0  # no data, no backward


@pytest.mark.parametrize("shards", [1, 3])
def test_parameter_server_overlap_gives_the_bits_of_overlap_off(shards):
    parts = random_parts([9, 5])
    common = dict(strategy="ps", num_workers=2, ps_shards=shards)
    on_stats, _ = _train(_spec(overlap=True, **common), parts)
    off_stats, _ = _train(_spec(overlap=False, **common), parts)
    assert {s["param_digest"] for s in on_stats} == {s["param_digest"] for s in off_stats}
    assert len({s["param_digest"] for s in on_stats}) == 1
    # one shard: nothing to overlap with, so the path stays the plain one (and says so)
    assert all(s["overlap"] is (shards > 1) for s in on_stats)


@pytest.mark.parametrize("strategy", ["ring", "ps"])
def test_unused_parameters_do_not_deadlock(strategy):
    """A layer without a gradient never completes its bucket from a hook: step() hands it
    over, on every rank in the same order."""
    parts = random_parts([7, 5])
    common = dict(strategy=strategy, num_workers=2, ps_shards=3, unused=True)
    on_stats, _ = _train(_spec(overlap=True, **common), parts)
    off_stats, _ = _train(_spec(overlap=False, **common), parts)
    assert len({s["param_digest"] for s in on_stats + off_stats}) == 1


def test_a_lost_peer_surfaces_as_peer_lost_in_the_training_thread(tmp_path):
    """Rank 1 dies at step 3 while rank 0's communication thread waits for it inside an
    allreduce: rank 0's step() raises PeerLostError naming rank 1 (bounded by the 5 s
    comm timeout; a hang would meet the test's timeout)."""
    fault = FaultPlan(rank=1, step=3, marker=str(tmp_path / "fault"))
    spec = _spec(strategy="ring", num_workers=2, overlap=True, comm_timeout=5.0)
    spec = dataclasses.replace(spec, fault=fault)
    results = _run_all(spec, random_parts([40, 40]))
    assert isinstance(results[0], PeerLostError), results
    assert results[0].rank == 1


# ------------------------------------------------------------ per-layer compression


@pytest.mark.parametrize("rest", ["int8+ef", "sign+ef"])
def test_mixed_policy_trains_each_bucket_with_its_compressor(rest):
    policy = {"fc2.*": "fp16", "*": rest}
    sizes = [13, 6]
    spec = _spec(strategy="ring", num_workers=2, compression=policy, bucket_mb=1.0, epochs=3)
    stats, records = _train(spec, random_parts(sizes))
    assert len({s["param_digest"] for s in stats}) == 1
    for s in stats:
        assert s["compression_path"] == {"fp16": "reduce", rest: "allgather"}
        # reverse order: fc3 (int8), fc2 (fp16), fc1 (int8); never two specs in a bucket
        assert [b["spec"] for b in s["compression_buckets"]] == [rest, "fp16", rest]
        assert [b["elements"] for b in s["compression_buckets"]] == [
            16 * 3 + 3,
            16 * 16 + 16,
            4 * 16 + 16,
        ]
        spec_figures = s["compression_by_spec"]
        # fp16 halves the bytes exactly (summable: the same ring, half the element size)
        fp16 = spec_figures["fp16"]
        steps = 3 * 4  # epochs x ceil(13 / 4)
        assert fp16["raw_bytes_sent"] == steps * ring_raw_bytes_sent(272, 2, s["rank"], 4)
        assert fp16["ratio"] > 1.2  # half the payload; frame headers and the count cost the rest
        int8 = spec_figures[rest]
        assert int8["path"] == "allgather" and int8["buckets"] == 2
        assert int8["ratio"] > 1.1  # 51- and 80-element buckets: headers weigh a lot
        # every byte on the mesh during training belongs to one bucket or the epochs' sums
        wire = sum(b["wire_bytes_sent"] for b in s["compression_buckets"])
        assert wire <= s["comm"]["wire_bytes_sent"]
    result = _assemble(Net(), records, spec.config, wall_s=1.0, stage_s=1.0)
    assert result.summary["replicas_in_sync"]
    assert np.isfinite(result.summary["final_loss"])


def test_buckets_never_mix_specs_and_follow_backward_order():
    torch.manual_seed(0)
    model = Net()
    params = list(model.parameters())
    specs = ["int8", "int8", "fp16", "fp16", "int8", "int8"]
    buckets = GradientBuckets(params, 1 << 20, specs)
    assert buckets.specs == ["int8", "fp16", "int8"]
    assert [len(b.params) for b in buckets.buckets] == [2, 2, 2]
    assert buckets.buckets[0].params[0] is model.fc3.bias  # the last layer goes first
    # the count slot lives in bucket 0 only when it is uncompressed
    assert not any(b.count_slot for b in buckets.buckets)
    plain = GradientBuckets(params, 1 << 20)
    assert [b.count_slot for b in plain.buckets] == [True]


def test_readiness_reports_buckets_in_index_order_during_backward():
    """With reverse-order buckets, backward completes bucket 0 first, then 1, ... and
    the first one is ready while later layers' gradients do not exist yet."""
    torch.manual_seed(0)
    model = Net()
    params = list(model.parameters())
    buckets = GradientBuckets(params, 300, None)  # about one parameter per bucket
    seen: list[tuple[int, bool]] = []
    ready = GradientReadiness(
        [b.params for b in buckets.buckets],
        lambda g: seen.append((g, model.fc1.weight.grad is None)),
    )
    model(torch.randn(5, 4)).sum().backward()
    assert seen == []  # not armed: an unrelated backward pass is ignored
    model.zero_grad(set_to_none=True)
    ready.arm()
    model(torch.randn(5, 4)).sum().backward()
    ready.disarm()
    assert [g for g, _ in seen] == list(range(len(buckets.buckets)))
    assert seen[0][1]  # bucket 0 was ready before fc1's gradient existed
    ready.arm()
    loss = model(torch.randn(5, 4)).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    with pytest.raises(RuntimeError, match="second gradient"):
        ready.disarm()
    ready.remove()


# ------------------------------------------------------------ the worker thread


def test_ordered_worker_keeps_order_and_reraises_the_same_error():
    done: list[int] = []
    boom = PeerLostError(3, "gone")

    def work(i: int) -> None:
        if i == 2:
            raise boom
        done.append(i)

    w = OrderedWorker("t", work)
    for i in range(2):
        w.submit(i)
    w.wait(5.0)
    assert done == [0, 1]
    for i in range(2, 5):
        w.submit(i)
    with pytest.raises(PeerLostError) as info:
        w.wait(5.0)
    assert info.value is boom
    assert done == [0, 1]  # nothing runs after the first failure
    w.close()


def test_ordered_worker_wait_is_bounded():
    release = threading.Event()
    w = OrderedWorker("t", lambda i: release.wait())  # never done until released
    w.submit(0)
    with pytest.raises(TimeoutError, match="1 exchanges made no progress"):
        w.wait(0.3)  # only its own bound can end this wait
    release.set()
    w.close()


def test_by_spec_sums_and_ratios():
    def row(index, spec, elements, raw, wire):
        path = "plain" if spec == "b" else "reduce"
        return {
            "index": index,
            "spec": spec,
            "path": path,
            "elements": elements,
            "raw_bytes_sent": raw,
            "wire_bytes_sent": wire,
        }

    # two ranks' rows: bytes add up, each bucket counts once
    rank0 = [row(0, "a", 3, 30, 15), row(1, "a", 1, 10, 5), row(2, "b", 2, 0, 0)]
    rank1 = [row(0, "a", 3, 30, 15), row(1, "a", 1, 10, 5), row(2, "b", 2, 0, 0)]
    rows = rank0 + rank1
    got = by_spec(rows)
    assert got["a"] == {
        "path": "reduce",
        "buckets": 2,
        "elements": 4,
        "raw_bytes_sent": 80,
        "wire_bytes_sent": 40,
        "ratio": 2.0,
    }
    assert got["b"]["ratio"] == 1.0


def test_ps_refuses_a_per_layer_table():
    check_compression_table("int8+ef")
    with pytest.raises(ConfigError, match="only strategy='ring' and strategy='tree'"):
        check_compression_table({"*": "int8"}, "ps")
    assert issubclass(PeerLostError, CommError)


# ------------------------------------------------------------ the bench


def test_bench_savings_and_table():
    from benchmarks.overlap import savings, table

    def rec(mode, median):
        return {
            "strategy": "ring",
            "mode": mode,
            "overlap": mode == "on",
            "overlap_active": mode == "on",
            "median_s": median,
            "min_s": median,
            "max_s": median,
            "windows": [median],
            "steps": 5,
            "groups": 3,
            "launched_in_backward": 15 if mode == "on" else 0,
        }

    records = [rec("compute", 0.10), rec("off", 0.20), rec("on", 0.15)]
    got = savings(records)["ring"]
    assert got["saving"] == pytest.approx(0.25)
    assert got["hidden"] == pytest.approx(0.5)  # 50 of the 100 exposed ms
    assert "15 of 15" in table(records)


def test_bench_runs_ranks_as_processes():
    """One tiny strategy end to end: two spawned ranks, ring, the three modes."""
    from benchmarks.overlap import run_strategy

    job = {
        "world": 2,
        "inputs": 8,
        "hidden": [16],
        "outputs": 3,
        "batch": 4,
        "bucket_mb": 1e-4,
        "ps_shards": 2,
        "threads": 1,
        "steps": 2,
        "repeats": 2,
        "warmup": 1,
        "link": "none",
        "timeout": 30.0,
        "budget_s": 100.0,
        "secret": "ab" * 32,
    }
    records = run_strategy(job, "ring")
    assert [r["mode"] for r in records] == ["compute", "off", "on"]
    on = records[2]
    assert on["steps"] == 4 and len(on["windows"]) == 2
    assert on["overlap_active"] and on["groups"] > 1
    assert on["launched_in_backward"] == on["groups"] * on["steps"]
    assert all(0 < r["min_s"] <= r["median_s"] <= r["max_s"] for r in records)
