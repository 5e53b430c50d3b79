"""Pipeline and hybrid data x pipeline training in threads, no Spark: parameters must
equal single-process training of the same model on the same batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparktrain.config import TrainConfig
from sparktrain.errors import ConfigError, DataError, PeerLostError
from sparktrain.parallel.partition import partition, split_costs
from sparktrain.parallel.pipeline import check_param_cap, layout
from sparktrain.parallel.schedule import gpipe, max_in_flight, one_f_one_b
from sparktrain.parallel.stage import micro_batches

from .fixtures import (
    PIPE_CLASSES,
    PIPE_WIDTH,
    assert_same_state,
    pipeline_model,
    pipeline_parts,
    pipeline_reference,
    pipeline_run,
    pipeline_spec,
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
