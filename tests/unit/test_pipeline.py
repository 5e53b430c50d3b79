"""Pipeline and hybrid data x pipeline training in threads, no Spark: parameters must
equal single-process training of the same model on the same batches."""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import numpy as np
import pytest
import torch

from sparktrain.checkpoint import RANK_SHARDS, CheckpointStore
from sparktrain.config import TrainConfig
from sparktrain.driver.services.state_receiver import StateReceiver
from sparktrain.errors import CheckpointError, ConfigError, DataError, PeerLostError
from sparktrain.parallel.partition import partition, split_costs
from sparktrain.parallel.pipeline import assemble, check_param_cap, layout
from sparktrain.parallel.schedule import gpipe, max_in_flight, one_f_one_b
from sparktrain.parallel.stage import micro_batches, state_senders
from sparktrain.task.faults import FaultPlan, InjectedFaultError
from sparktrain.task.run_task import run_partition

from .fixtures import (
    PIPE_CLASSES,
    PIPE_WIDTH,
    assert_same_state,
    pipeline_model,
    pipeline_parts,
    pipeline_records,
    pipeline_reference,
    pipeline_run,
    pipeline_spec,
    run_ranks,
    worker_context,
)

pytestmark = pytest.mark.timeout(180)


# ----------------------------------------------------------------------- schedules


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("micro", [1, 3, 8])
def test_1f1b_holds_at_most_p_micro_batches(stages, micro):
    for s in range(stages):
        ops = one_f_one_b(s, stages, micro)
        assert sorted(ops) == sorted(gpipe(s, stages, micro))  # same work
        assert [i for k, i in ops if k == "B"] == list(range(micro))
        assert max_in_flight(ops) <= min(stages - s, micro) <= stages
        assert max_in_flight(gpipe(s, stages, micro)) == micro


def test_micro_batches_split_evenly_and_drop_empties():
    got = micro_batches(np.arange(10), 4)
    assert [len(m) for m in got] == [3, 3, 2, 2]
    assert [len(m) for m in micro_batches(np.arange(2), 4)] == [1, 1]
    assert micro_batches(np.zeros(0, np.int64), 4) == []


# ----------------------------------------------------------------------- partition


def test_split_costs_balances_and_respects_the_cap():
    assert split_costs([1, 1, 1, 1], [0] * 4, 2) == (0, 2, 4)
    assert split_costs([5, 1, 1, 1, 1, 1], [0] * 6, 2) == (0, 1, 6)
    assert split_costs([1, 1, 1, 1], [10, 10, 10, 10], 2, cap_bytes=30) in [(0, 2, 4)]
    assert split_costs([1, 1, 1, 9], [10, 1, 1, 1], 2, cap_bytes=12) == (0, 3, 4)
    with pytest.raises(ConfigError, match="max_param_mb"):
        split_costs([1, 1], [10, 10], 2, cap_bytes=5)
    with pytest.raises(ConfigError, match="only 2"):
        split_costs([1, 1], [1, 1], 3)


def test_partition_by_time_and_params_covers_the_model():
    model = pipeline_model()
    for balance in ("time", "params"):
        part = partition(model, 3, PIPE_WIDTH, balance=balance)
        assert part.bounds[0] == 0 and part.bounds[-1] == len(model)
        assert all(a < b for a, b in zip(part.bounds, part.bounds[1:], strict=False))
        assert part.shapes[0] == (PIPE_WIDTH,) and part.shapes[-1] == (PIPE_CLASSES,)
        assert sum(part.param_bytes) == sum(p.numel() * 4 for p in model.parameters())


def test_layout_and_param_cap():
    assert layout(TrainConfig(num_workers=4, parallelism_pipeline=2)) == (2, 2)
    assert layout(TrainConfig(num_workers=2, parallelism_pipeline=2, parallelism_data=1)) == (2, 1)
    with pytest.raises(ConfigError, match="num_workers"):
        layout(TrainConfig(num_workers=3, parallelism_pipeline=2))
    cfg = TrainConfig(num_workers=2)
    object.__setattr__(cfg, "max_param_mb", 0.0001)
    with pytest.raises(ConfigError, match="max_param_mb"):
        check_param_cap(pipeline_model(), cfg)


# ----------------------------------------------------------------------- correctness


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("stages", "replicas"), [(2, 1), (3, 1), (2, 2)])
def test_pipeline_equals_single_process(stages, replicas, schedule):
    spec = pipeline_spec(stages, replicas, schedule=schedule)
    # uneven partitions; replica 1 has fewer rows (runs out of data a step early)
    sizes = [17, 9, 5, 11, 6, 8][: stages * replicas]
    if replicas == 2:
        sizes = [17, 9, 5, 6]
    parts = pipeline_parts(sizes)
    result = pipeline_run(spec, parts)
    assert_same_state(result.model, pipeline_reference(spec, parts))
    s = result.summary
    assert s["replicas_in_sync"]
    assert s["world_size"] == stages * replicas and s["pipeline_stages"] == stages
    assert s["train_samples"] == sum(sizes)
    assert s["stage_bytes_per_step"] > 0
    assert 0.0 <= s["bubble_fraction"] <= 1.0
    assert s["peak_in_flight_micro_batches"] <= (stages if schedule == "1f1b" else 3)
    assert s["metric_name"] == "train_accuracy" and 0.0 <= s["metric_value"] <= 1.0
    assert len(s["history"]) == spec.job.config.epochs


def test_1f1b_bounds_in_flight_activations_by_p():
    parts = pipeline_parts([40, 40])
    peaks = {}
    for schedule in ("gpipe", "1f1b"):
        spec = pipeline_spec(
            2, 1, schedule=schedule, micro=8, batch_size=40, epochs=1, shuffle=False
        )
        s = pipeline_run(spec, parts).summary
        peaks[schedule] = s["peak_activation_bytes"]
        assert s["peak_in_flight_micro_batches"] == (2 if schedule == "1f1b" else 8)
    assert peaks["1f1b"] < peaks["gpipe"]


def test_hybrid_with_compressed_group_allreduce():
    spec = pipeline_spec(2, 2, compression="fp16")
    parts = pipeline_parts([12, 12, 12, 12])
    result = pipeline_run(spec, parts)
    assert_same_state(result.model, pipeline_reference(spec, parts), atol=1e-2)
    assert result.summary["replicas_in_sync"]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_activations(dtype):
    spec = pipeline_spec(2, 1, activation_dtype=dtype, shuffle=False)
    parts = pipeline_parts([20, 20])
    result = pipeline_run(spec, parts)
    assert_same_state(result.model, pipeline_reference(spec, parts), atol=5e-2)
    full = pipeline_spec(2, 1, shuffle=False)
    bytes32 = pipeline_run(full, parts).summary["stage_bytes_per_step"]
    assert result.summary["stage_bytes_per_step"] == pytest.approx(bytes32 / 2)


def test_validation_rows_give_the_accuracy_of_the_assembled_model():
    spec = pipeline_spec(2, 1, validation_fraction=0.3, epochs=3)
    parts = pipeline_parts([30, 30])
    result = pipeline_run(spec, parts)
    assert result.summary["metric_name"] == "accuracy"
    # recompute on the validation rows each rank held out
    xs, ys = [], []
    for rank, p in enumerate(parts):
        _, val = p.split(0.3, spec.job.config.seed, rank)
        xs.append(val.x)
        ys.append(val.y)
    x, y = torch.from_numpy(np.concatenate(xs)), torch.from_numpy(np.concatenate(ys))
    with torch.no_grad():
        acc = float((result.model(x).argmax(1) == y.long()).double().mean())
    assert result.summary["metric_value"] == pytest.approx(acc)


# ----------------------------------------------------------------------- failures


def test_bad_labels_on_one_rank_fail_every_rank_before_training():
    spec = pipeline_spec(2, 1)
    parts = pipeline_parts([10, 10])
    parts[1].y[3] = 7  # not a class index
    with pytest.raises(DataError, match="rank 1"):
        pipeline_run(spec, parts)


def test_a_stage_that_dies_mid_step_stops_its_neighbours(monkeypatch):
    from sparktrain.parallel import stage as stage_mod

    real_step = stage_mod._StageRunner._step
    calls = {"n": 0}

    def dying_step(self, *args, **kwargs):
        if self.stage == 1:
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("stage 1 died")
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(stage_mod._StageRunner, "_step", dying_step)
    spec = pipeline_spec(2, 1, comm_timeout=5.0)
    with pytest.raises((RuntimeError, PeerLostError)):
        pipeline_run(spec, pipeline_parts([30, 30]))


# ----------------------------------------------------------------------- start, resume, state


def _stats(records) -> list[dict]:
    return [json.loads(r.data) for r in records if r.kind == "stats"]


def _raw_state(model: torch.nn.Module) -> list[bytes]:
    return [t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            for t in model.state_dict().values()]  # fmt: skip


def _slow_model() -> torch.nn.Sequential:
    """``pipeline_model``'s layers, built with a pause after the first: another thread
    draws from torch's global RNG meanwhile, and the later layers' initial weights differ."""
    first = pipeline_model()[0]
    time.sleep(0.02)
    return torch.nn.Sequential(first, *pipeline_model()[1:])


def test_replicas_of_a_stage_start_from_replica0_while_another_thread_draws_random_numbers():
    """Seeding before the build is not enough when another thread of the process draws
    from torch's global RNG meanwhile: each stage's replicas take replica 0's weights."""
    spec = pipeline_spec(2, 3, epochs=1)
    spec = dataclasses.replace(spec, job=dataclasses.replace(spec.job, model_fn=_slow_model))
    stop = threading.Event()

    def noise() -> None:
        while not stop.is_set():
            torch.rand(8)

    thread = threading.Thread(target=noise, daemon=True)
    thread.start()
    try:
        records = pipeline_records(spec, pipeline_parts([8] * 6))
    finally:
        stop.set()
        thread.join()
    stats = _stats(records)
    for stage in range(2):
        mine = [s for s in stats if s["stage"] == stage]
        assert len(mine) == 3
        assert len({s["start_digest"] for s in mine}) == 1, stage
        assert len({s["param_digest"] for s in mine}) == 1, stage


@pytest.mark.parametrize("compression", ["none", "int8+ef"])
def test_a_pipeline_resumed_from_its_checkpoint_equals_an_unbroken_run(tmp_path, compression):
    """Killed at step 7 of 12 (stage 1 of replica 1 fails), resumed from the newest
    checkpoint (every half epoch = every 2 steps): bitwise the weights of an unbroken run.
    The schedule is deterministic (same micro-batches, same order of every sum), so is
    the group allreduce; compressor residuals travel in every rank's shard."""
    common = {
        "epochs": 3,
        "batch_size": 5,
        "checkpoint_every": 0.5,
        "optimizer_kwargs": {"momentum": 0.9},
        "compression": compression,
    }
    parts = pipeline_parts([9, 8, 11, 7])
    unbroken = pipeline_run(
        pipeline_spec(2, 2, checkpoint_dir=str(tmp_path / "a"), **common), parts
    )

    spec = pipeline_spec(2, 2, checkpoint_dir=str(tmp_path / "b"), **common)
    plan = FaultPlan(rank=3, step=7, marker=str(tmp_path / "fault"))
    faulty = dataclasses.replace(spec, job=dataclasses.replace(spec.job, fault=plan))
    with pytest.raises((InjectedFaultError, PeerLostError)):
        pipeline_run(faulty, parts)
    store = CheckpointStore(str(tmp_path / "b"))
    resume = store.newest_intact()
    assert resume == 6  # steps 2, 4, 6 were checkpointed before the fault
    ckpt = store.load(resume)
    assert ckpt is not None and ckpt.extra[RANK_SHARDS] == 4
    assert ckpt.extra["pipeline"] == {
        "stages": 2,
        "replicas": 2,
        "bounds": [*spec.partition.bounds],
    }
    again = dataclasses.replace(
        faulty, job=dataclasses.replace(faulty.job, attempt=1, resume_step=resume)
    )
    resumed = pipeline_run(again, parts)
    assert _raw_state(resumed.model) == _raw_state(unbroken.model)
    assert [h["epoch"] for h in resumed.history] == [0, 1, 2]
    for epoch in (0, 2):  # epoch 0 from the checkpoint, epoch 2 run whole after the resume
        for key in ("loss", "metric"):
            assert resumed.history[epoch][key] == unbroken.history[epoch][key], (epoch, key)
    assert resumed.summary["replicas_in_sync"]


def test_a_checkpoint_of_another_split_is_refused_and_its_own_split_resumes(tmp_path):
    parts = pipeline_parts([9, 8])
    pipeline_run(pipeline_spec(2, 1, checkpoint_dir=str(tmp_path), epochs=1), parts)
    spec = pipeline_spec(2, 1, checkpoint_dir=str(tmp_path), epochs=2)
    ckpt = CheckpointStore(str(tmp_path)).load()
    assert ckpt is not None
    saved = ckpt.extra["pipeline"]["bounds"]
    other = (0, 2, 7) if saved != [0, 2, 7] else (0, 3, 7)
    job = dataclasses.replace(spec.job, resume_step=ckpt.step)
    moved = dataclasses.replace(
        spec, job=job, partition=partition(pipeline_model(), 2, PIPE_WIDTH, bounds=other)
    )
    with pytest.raises(CheckpointError, match="same split"):
        pipeline_records(moved, parts)
    again = dataclasses.replace(
        spec, job=job, partition=partition(pipeline_model(), 2, PIPE_WIDTH, bounds=saved)
    )
    assert len(pipeline_run(again, parts).history) == 2


def test_data_parallel_refuses_to_resume_a_pipeline_checkpoint(tmp_path):
    parts = pipeline_parts([9, 8])
    spec = pipeline_spec(2, 1, checkpoint_dir=str(tmp_path), epochs=1)
    pipeline_run(spec, parts)
    step = CheckpointStore(str(tmp_path)).latest_step()
    job = dataclasses.replace(spec.job, resume_step=step)

    def rank_fn(rank, coll):
        return run_partition(worker_context(rank, 2, coll, job), parts[rank])

    with pytest.raises(CheckpointError, match="written by a pipeline run"):
        run_ranks(2, rank_fn)


def test_partition_with_given_bounds():
    part = partition(pipeline_model(), 3, PIPE_WIDTH, bounds=(0, 1, 5, 7))
    assert part.bounds == (0, 1, 5, 7) and part.shapes == (
        (PIPE_WIDTH,),
        (16,),
        (8,),
        (PIPE_CLASSES,),
    )
    for bad in [(0, 3, 3, 7), (0, 2, 7), (1, 3, 5, 7), (0, 3, 5, 8)]:
        with pytest.raises(ConfigError, match="non-empty stages"):
            partition(pipeline_model(), 3, PIPE_WIDTH, bounds=bad)
    with pytest.raises(ConfigError, match="max_param_mb"):
        partition(pipeline_model(), 3, PIPE_WIDTH, bounds=(0, 1, 5, 7), max_param_bytes=100)


def test_stages_stream_their_parts_into_the_drivers_model():
    """Each stage's replica 0 streams its keys to the one receiver (several senders at
    once); nothing big is a task result, and the model equals the records' one."""
    spec = pipeline_spec(3, 2)
    parts = pipeline_parts([7, 9, 5, 8, 6, 10])
    want = pipeline_run(spec, parts).model
    torch.manual_seed(99)
    driver = pipeline_model()  # other weights than the trained ones
    senders = state_senders(spec, driver)
    assert sorted(senders) == [0, 1, 2]  # world rank of each stage's replica 0
    assert sorted(k for keys in senders.values() for k in keys) == sorted(driver.state_dict())
    receiver = StateReceiver(
        "127.0.0.1", driver, secret=spec.job.secret, job_id="p", attempt=0, senders=senders
    )
    try:
        job = dataclasses.replace(spec.job, state_address=receiver.address)
        streamed = dataclasses.replace(spec, job=job)
        records = pipeline_records(streamed, parts)
        assert receiver.done.is_set() and receiver.pending == []
    finally:
        receiver.stop()
    assert not [r for r in records if r.kind == "state"]
    metas = [json.loads(r.data) for r in records if r.kind == "meta"]
    assert sorted(m["stage"] for m in metas) == [0, 1, 2] and all(m["streamed"] for m in metas)
    result = assemble(driver, records, streamed, wall_s=1.0, stage_s=1.0)
    assert result.model is driver
    assert _raw_state(driver) == _raw_state(want)
    assert len(result.history) == spec.job.config.epochs
