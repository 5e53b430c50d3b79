"""``shard_optimizer`` (ZeRO-1): the ring's halves, and training with sharded optimizer
state against unsharded training on the same data (threads, no Spark)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from sparktrain.builders import build_optimizer
from sparktrain.checkpoint import CheckpointStore
from sparktrain.config import TrainConfig
from sparktrain.driver.job import check_job
from sparktrain.errors import CheckpointError, CommError, ConfigError, PeerLostError
from sparktrain.task.faults import FaultPlan, InjectedFaultError
from sparktrain.task.run_context import RunContext
from sparktrain.wire.ring import RingAllreduce, ring_segments

from .fixtures import (
    loop_spec,
    raise_first,
    random_parts,
    rank0_value,
    run_in_threads,
    run_mesh_ranks,
    seeded_mlp,
    spec_with,
    train_and_assemble,
    train_in_threads,
)

pytestmark = pytest.mark.timeout(120)


def max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    """The largest absolute difference between two models' parameters."""
    return max(
        float((x.detach() - y.detach()).abs().max())
        for x, y in zip(a.parameters(), b.parameters(), strict=True)
    )


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("length", [1, 7, 300_001])  # 300k float32: the sender thread
def test_ring_halves_give_the_allreduces_bytes(world, length):
    rng = np.random.default_rng(length)
    data = [rng.standard_normal(length).astype(np.float32) for _ in range(world)]

    def body(rank, mesh):
        ring = RingAllreduce(mesh, chunk_bytes=64 << 10)
        full = data[rank].copy()
        ring.allreduce_(full)
        halves = data[rank].copy()
        start, stop = ring.reduce_scatter_(halves)
        assert (start, stop) == ring_segments(length, world)[ring.owned_segment()]
        owned = halves[start:stop].copy()
        halves[:start] = np.nan  # the rest is never read by the all-gather
        halves[stop:] = np.nan
        ring.allgather_(halves)
        return full, owned, halves, (start, stop)

    results = run_mesh_ranks(world, body, timeout=20.0)
    raise_first(results)
    for full, owned, halves, (start, stop) in results:
        assert full.tobytes() == halves.tobytes() == results[0][0].tobytes()
        assert owned.tobytes() == full[start:stop].tobytes()
    # every segment is owned by exactly one rank
    assert sorted(r[3] for r in results) == sorted(ring_segments(length, world))


CASES = [
    ("sgd", {"momentum": 0.9}),
    ("adam", {}),
    ("adamw", {"weight_decay": 0.1}),
]


@pytest.mark.parametrize("optimizer,kwargs", CASES)
@pytest.mark.parametrize("sizes", [[13, 5], [11, 0, 7]])
def test_sharded_ring_equals_unsharded_bitwise(optimizer, kwargs, sizes):
    """The same summed bytes (each segment reduced in the same ring order), the same
    elementwise optimizer math on a slice: bitwise the same weights."""
    common = {
        "strategy": "ring",
        "optimizer": optimizer,
        "optimizer_kwargs": kwargs,
        "lr": 0.05 if optimizer == "sgd" else 0.01,
        "batch_size": 4,
        "shuffle": True,
        "epochs": 2,
        "num_workers": len(sizes),
        "bucket_mb": 0.0002,  # several buckets of uneven length
    }
    parts = random_parts(sizes)
    plain = train_and_assemble(loop_spec(**common), parts)
    sharded = train_and_assemble(loop_spec(shard_optimizer=True, **common), parts)
    assert max_diff(sharded.model, plain.model) == 0.0
    assert sharded.summary["replicas_in_sync"]
    assert sharded.summary["shard_optimizer"] and "shard_optimizer" not in plain.summary
    owned = sharded.summary["optimizer_state_elements_per_worker"]
    assert len(owned) == len(sizes)
    assert sum(owned) == sum(p.numel() for p in plain.model.parameters())


@pytest.mark.parametrize(
    "extra,sizes,bound",
    [
        # the same arithmetic in the same order: bitwise
        ({"strategy": "ring", "accumulate_steps": 2}, [8, 8, 8], 0.0),
        # ranks fill different numbers of micro-batches in a step
        ({"strategy": "ring", "accumulate_steps": 3}, [9, 4, 6], 0.0),
        (
            {
                "strategy": "ring",
                "lr_schedule": "CosineAnnealingLR",
                "lr_schedule_kwargs": {"T_max": 5},
                "warmup_steps": 2,
            },
            [9, 4, 6],
            0.0,
        ),
        ({"strategy": "ring", "precision": "bf16"}, [9, 4, 6], 0.0),
        ({"strategy": "ring", "overlap": False}, [9, 4, 6], 0.0),  # no gradient hooks
        # another order of additions: the tree sums otherwise than the ring's halves,
        # and the clipping norm comes from the slices in float64 (measured: 1.5e-8)
        ({"strategy": "tree"}, [9, 4, 6], 1e-6),
        ({"strategy": "ring", "clip_grad_norm": 0.05}, [9, 4, 6], 1e-6),
    ],
)
def test_sharded_equals_unsharded_with_the_loops_features(extra, sizes, bound):
    common = {
        "optimizer": "adam",
        "lr": 0.01,
        "batch_size": 4,
        "shuffle": True,
        "epochs": 2,
        "num_workers": 3,
        **extra,
    }
    parts = random_parts(sizes)
    plain = train_and_assemble(loop_spec(**common), parts)
    sharded = train_and_assemble(loop_spec(shard_optimizer=True, **common), parts)
    diff = max_diff(sharded.model, plain.model)
    assert diff <= bound, diff
    if "clip_grad_norm" in extra:  # clipping did act: without it the weights differ
        unclipped = train_and_assemble(loop_spec(**{**common, "clip_grad_norm": 0.0}), parts)
        assert max_diff(unclipped.model, plain.model) > 1e-3


def test_optimizer_state_is_sharded():
    outputs = train_in_threads(
        loop_spec(shard_optimizer=True, optimizer="adam", lr=0.01, num_workers=3),
        random_parts([6, 6, 6]),
    )
    stats = [json.loads(r.data) for out in outputs for r in out if r.kind == "stats"]
    owned = sorted(s["optimizer_state_elements"] for s in stats)
    total = 4 * 8 + 8 + 8 * 3 + 3  # the MLP's parameters
    assert sum(owned) == total
    assert max(owned) - min(owned) <= 2  # ~1/3 each (segments of the buckets)
    assert all(s["shard_optimizer"] for s in stats)


def test_resume_with_permuted_ranks_equals_an_unbroken_run(tmp_path):
    """Full batches: the step's gradient is the same sum whichever rank holds which
    partition, so a resume with the partitions (and so the ranks) swapped must continue
    the unbroken run, with each slice's Adam moments restored by its segment."""
    common = {
        "epochs": 4,
        "batch_size": 1000,
        "optimizer": "adam",
        "lr": 0.01,
        "shard_optimizer": True,
        "checkpoint_every": 1.0,
    }
    parts = random_parts([10, 7])
    unbroken = train_and_assemble(loop_spec(**common), parts)

    spec = loop_spec(checkpoint_dir=str(tmp_path / "b"), **common)
    plan = FaultPlan(rank=1, step=3, marker=str(tmp_path / "fault"))
    with pytest.raises((InjectedFaultError, PeerLostError)):
        train_in_threads(spec_with(spec, fault=plan), parts)
    store = CheckpointStore(str(tmp_path / "b"))
    step = store.latest_step()
    assert step is not None and 0 < step < 4
    shard = store.load_shard(step, 1, 2)["zero1"]
    assert shard["segment"] == 0 and shard["optimizer"]["state"]  # rank 1 owns segment 0
    resumed = spec_with(spec, fault=plan, attempt=1, resume_step=step)
    swapped = train_and_assemble(resumed, parts[::-1])
    diff = max_diff(swapped.model, unbroken.model)
    assert diff <= 1e-6, diff


def test_resume_refuses_another_world_size(tmp_path):
    common = {"epochs": 2, "batch_size": 1000, "optimizer": "adam", "shard_optimizer": True}
    spec = loop_spec(checkpoint_dir=str(tmp_path), **common)
    train_in_threads(spec, random_parts([5, 5]))
    step = CheckpointStore(str(tmp_path)).latest_step()
    three = spec_with(spec, config=spec.config.replace(num_workers=3), resume_step=step)
    with pytest.raises(CheckpointError, match="same world size"):
        train_in_threads(three, random_parts([5, 5, 5]))
    plain = spec_with(spec, config=spec.config.replace(shard_optimizer=False), resume_step=step)
    with pytest.raises(CheckpointError, match="resume with shard_optimizer=true"):
        train_in_threads(plain, random_parts([5, 5]))


@pytest.mark.parametrize(
    "extra,match",
    [
        ({"strategy": "ps"}, "strategy='ring' or 'tree'"),
        ({"strategy": "tree_aggregate"}, "strategy='ring' or 'tree'"),
        ({"strategy": "auto"}, "strategy='ring' or 'tree'"),
        ({"compression": "int8"}, "compression='none'"),
        ({"comm_backend": "torch"}, "comm_backend='sparktrain'"),
        ({"parallelism_pipeline": 2}, "parallelism.pipeline"),
        ({"precision": "fp16"}, "precision='fp16'"),
        ({"device": "cuda"}, "CPU"),
        ({"shard_optimizer": "yes"}, "true or false"),
    ],
)
def test_unsupported_combinations_are_refused(extra, match):
    with pytest.raises(ConfigError, match=match):
        check_job(TrainConfig(**{"shard_optimizer": True, **extra}))


def _adam_train_fn(ctx: RunContext) -> dict[str, Any]:
    cfg = ctx.config
    model = seeded_mlp(cfg.seed)
    optimizer = build_optimizer("adam", model.parameters(), cfg.lr, {})
    model, optimizer = ctx.distributed(model, optimizer)
    for epoch in range(cfg.epochs):
        for batch in ctx.batches(epoch):
            ctx.backward(F.cross_entropy(model(batch.x), batch.y.long()))
            optimizer.step()
            optimizer.zero_grad()
        ctx.report(epoch=epoch)
    sync = ctx.distributed_step.sync if ctx.distributed_step is not None else None
    holder = getattr(sync, "shard_optimizer", None) or optimizer
    elements = sum(s["exp_avg"].numel() for s in holder.state.values())
    return {"state": model.state_dict(), "moments": len(optimizer.state), "held": elements}


def test_ctx_distributed_shards_a_users_optimizer():
    parts = random_parts([9, 6])
    common = {"batch_size": 4, "epochs": 2, "lr": 0.01, "shuffle": True}
    plain, _ = rank0_value(run_in_threads(loop_spec(**common), parts, _adam_train_fn))
    sharded, _ = rank0_value(
        run_in_threads(loop_spec(shard_optimizer=True, **common), parts, _adam_train_fn)
    )
    assert plain["moments"] == 4 and sharded["moments"] == 0  # the user's Adam holds none
    total = 4 * 8 + 8 + 8 * 3 + 3
    assert plain["held"] == total and sharded["held"] == total // 2  # rank 0's half
    for key, value in plain["state"].items():
        assert torch.equal(sharded["state"][key], value), key


def test_ctx_distributed_refuses_several_parameter_groups():
    def train_fn(ctx: RunContext) -> None:
        model = seeded_mlp(0)
        first, *rest = model.parameters()
        optimizer = torch.optim.SGD([{"params": [first]}, {"params": rest}], lr=0.1)
        ctx.distributed(model, optimizer)

    with pytest.raises(ConfigError, match="one parameter group"):
        run_in_threads(loop_spec(shard_optimizer=True), random_parts([3, 3]), train_fn)


def test_the_ml_param_maps_onto_train_config() -> None:
    from sparktrain.ml import TorchClassificationModel, TorchClassifier, TorchRegressor

    for cls in (TorchClassifier, TorchRegressor):
        assert cls()._train_config().shard_optimizer is False
        assert cls(shardOptimizer=True)._train_config().shard_optimizer is True
        assert cls().setShardOptimizer(True).getShardOptimizer() is True
    clf = TorchClassifier(shardOptimizer=True)
    model = TorchClassificationModel()
    clf._copyValues(model)
    assert model.getShardOptimizer() is True
    with pytest.raises(ConfigError, match="compression='none'"):
        TorchClassifier(shardOptimizer=True, compression="int8")._train_config()


def _sync_steps(shard: bool, data: list[torch.Tensor]) -> list[torch.Tensor]:
    """Three ``sync.step(count)`` calls (the bench's path, no DistributedStep) of the
    loop MLP on each rank's rows; every rank's flat parameters afterwards."""
    from sparktrain.task.step_sync import make_sync

    from .fixtures import ThreadCollectives, worker_context

    spec = loop_spec(shard_optimizer=shard, optimizer="adam", lr=0.01, bucket_mb=0.0002)
    coll = ThreadCollectives(len(data))

    def body(rank, mesh):
        model = seeded_mlp(0)
        sync = make_sync(worker_context(rank, len(data), coll, spec), model, mesh)
        try:
            for _ in range(3):
                x = data[rank]
                F.cross_entropy(model(x), torch.zeros(len(x), dtype=torch.long)).backward()
                sync.step(len(x))
        finally:
            sync.close()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    results = run_mesh_ranks(len(data), body, timeout=20.0)
    raise_first(results)
    return results


def test_the_syncs_own_step_shards_too():
    gen = torch.Generator().manual_seed(3)
    data = [torch.randn(n, 4, generator=gen) for n in (5, 2, 4)]
    plain, sharded = _sync_steps(False, data), _sync_steps(True, data)
    for p, s in zip(plain, sharded, strict=True):
        assert torch.equal(p, s)
    start = torch.cat([p.detach().reshape(-1) for p in seeded_mlp(0).parameters()])
    assert float((plain[0] - start).abs().max()) > 1e-3  # the steps did move the weights


def _resumable_fn(ctx: RunContext) -> dict[str, Any]:
    """Adam through ctx.distributed, a checkpoint every epoch, resuming from ctx.restore()."""
    model = seeded_mlp(ctx.config.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model, optimizer = ctx.distributed(model, optimizer)
    state, start = ctx.restore(), 0
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["epoch"] + 1
    for epoch in range(start, ctx.config.epochs):
        for batch in ctx.batches(epoch):
            ctx.backward(F.cross_entropy(model(batch.x), batch.y.long()))
            optimizer.step()
            optimizer.zero_grad()
        ctx.report(epoch_done=float(epoch))
        ctx.checkpoint(
            {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}
        )
    return {"state": model.state_dict(), "started_at": start}


def test_ctx_checkpoint_restores_the_slices_bitwise(tmp_path):
    parts = random_parts([48, 40], seed=5)
    base = {"batch_size": 16, "epochs": 4, "shard_optimizer": True}
    clean = loop_spec(**base, checkpoint_dir=str(tmp_path / "clean"))
    want, _ = rank0_value(run_in_threads(clean, parts, _resumable_fn))

    spec = loop_spec(**base, checkpoint_dir=str(tmp_path / "killed"))
    fault = FaultPlan(1, 7, str(tmp_path / "fired"))
    with pytest.raises((InjectedFaultError, CommError)):
        run_in_threads(spec_with(spec, fault=fault), parts, _resumable_fn)
    step = CheckpointStore(spec.config.checkpoint_dir).newest_intact()
    assert step == 6  # after epoch 1 (3 steps an epoch)
    got, _ = rank0_value(run_in_threads(spec_with(spec, resume_step=step), parts, _resumable_fn))
    assert got["started_at"] == 2
    for name, tensor in want["state"].items():
        assert torch.equal(got["state"][name], tensor), name
