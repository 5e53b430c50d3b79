"""Placement: the config's ``device`` and the GPUs Spark gave a task (task/device.py),
every branch without a GPU; the task side records it, and ``device="cuda"`` without a
GPU fails on every rank alike before any socket."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from sparktrain.config import TrainConfig
from sparktrain.driver.barrier import task_gpus
from sparktrain.driver.job import check_job
from sparktrain.driver.spark_env import ClassicEnv
from sparktrain.errors import ConfigError, ResourceError
from sparktrain.task.device import cuda_index, device_for, place, resolve
from tests.unit.fixtures import (
    assert_close_params,
    loop_spec,
    random_parts,
    sgd_reference,
    spec_with,
    train_and_assemble,
    train_in_threads,
)


def test_config_checks_device_and_gpus_per_task():
    assert TrainConfig().device == "auto" and TrainConfig().gpus_per_task == 0
    with pytest.raises(ConfigError, match="device='tpu'.*auto, cpu, cuda"):
        TrainConfig(device="tpu")
    with pytest.raises(ConfigError, match="gpus_per_task"):
        TrainConfig(gpus_per_task=-1)
    with pytest.raises(
        ConfigError, match="device='cuda' trains with strategy='ring', 'tree' or 'auto'"
    ):
        check_job(TrainConfig(device="cuda", strategy="ps"))
    assert TrainConfig.from_dict({"device": "cuda", "gpus_per_task": 1}).gpus_per_task == 1


def test_auto_falls_back_to_the_cpu():
    got = resolve("auto", (), cuda_available=True, device_count=2)
    assert got.device == torch.device("cpu") and "no GPU assigned" in got.reason
    got = resolve("auto", ("1",), cuda_available=False)
    assert got.device == torch.device("cpu") and got.gpus == ("1",) and got.gpu is None
    assert "CUDA is not available" in got.reason


def test_auto_and_cuda_pin_the_first_assigned_gpu():
    for requested in ("auto", "cuda"):
        got = resolve(requested, ("1", "0"), cuda_available=True, device_count=2)
        assert got.device == torch.device("cuda", 1) and got.gpu == "1"
    assert resolve("cpu", ("0",), cuda_available=True, device_count=1).device.type == "cpu"


def test_cuda_without_a_gpu_or_without_cuda_is_a_clear_error():
    with pytest.raises(ResourceError, match="assigned this task no GPU.*gpus_per_task"):
        resolve("cuda", (), cuda_available=True, device_count=1)
    with pytest.raises(ResourceError, match="CUDA is not available.*GPU '0'"):
        resolve("cuda", ("0",), cuda_available=False)


def test_cuda_index_follows_cuda_visible_devices():
    assert cuda_index("3", None, 4) == 3
    assert cuda_index("3", "2,3", 2) == 1  # ordinals count the visible devices
    assert cuda_index("7", "5", 1) == 0  # isolation left the task its one GPU
    with pytest.raises(ResourceError, match="does not list it"):
        cuda_index("7", "1,2", 2)
    with pytest.raises(ResourceError, match="sees 2 CUDA device"):
        cuda_index("5", None, 2)
    with pytest.raises(ResourceError, match="not a CUDA ordinal"):
        cuda_index("gpu-a", None, 2)


def test_strategies_without_a_gpu_path_train_on_the_cpu():
    assert device_for(TrainConfig(device="auto", strategy="ring")) == "auto"
    assert device_for(TrainConfig(device="auto", strategy="ps")) == "cpu"
    assert device_for(TrainConfig(device="auto", parallelism_pipeline=2)) == "cpu"


def test_task_gpus_reads_the_task_resources():
    class Task:
        def __init__(self, resources):
            self._r = resources

        def resources(self):
            return self._r

    gpu = SimpleNamespace(name="gpu", addresses=["2", "3"])
    assert task_gpus(Task({"gpu": gpu})) == ("2", "3")
    assert task_gpus(Task({})) == ()
    assert task_gpus(object()) == ()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback")
def test_place_on_this_machine():
    assert place("auto", ("0",)).device.type == "cpu"
    with pytest.raises(ResourceError):
        place("cuda", ("0",))


def _with_gpus(monkeypatch, gpus):
    """Thread-harness tasks that Spark gave ``gpus[rank]``."""
    import tests.unit.fixtures as fx

    make = fx.worker_context

    def ctx(rank, world, coll, spec):
        c = make(rank, world, coll, spec)
        c.gpus = gpus[rank]
        return c

    monkeypatch.setattr(fx, "worker_context", ctx)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback")
def test_the_summary_records_each_ranks_gpu_and_device(monkeypatch):
    _with_gpus(monkeypatch, [("0",), ("1",)])
    outputs = train_in_threads(loop_spec(), random_parts([7, 5]))
    stats = [json.loads(r.data) for out in outputs for r in out if r.kind == "stats"]
    got = sorted((s["rank"], s["gpus"], s["gpu"], s["device"]) for s in stats)
    assert got == [(0, ["0"], None, "cpu"), (1, ["1"], None, "cpu")]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback")
def test_cuda_without_cuda_fails_on_every_rank_before_any_socket(monkeypatch):
    import sparktrain.task.run_task as run_task

    _with_gpus(monkeypatch, [("0",), ("1",)])

    def no_rendezvous(*args, **kwargs):
        raise AssertionError("a rank reached the rendezvous")

    monkeypatch.setattr(run_task, "rendezvous", no_rendezvous)
    with pytest.raises(ResourceError, match="device='cuda' but CUDA is not available"):
        train_in_threads(spec_with(loop_spec(device="cuda")), random_parts([7, 5]), timeout=20)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch.cuda.is_available() is False")
@pytest.mark.parametrize("compression", ["none", "fp16"])
def test_training_on_the_gpu_matches_full_batch_sgd(monkeypatch, compression):
    """Both ranks on cuda:0 (threads), gradients staged through pinned host buckets:
    the model equals full-batch SGD in one process, as on the CPU."""
    _with_gpus(monkeypatch, [("0",), ("0",)])
    spec = loop_spec(device="cuda", compression=compression)
    parts = random_parts([7, 5])
    result = train_and_assemble(spec, parts)
    assert {p["device"] for p in result.summary["placement"]} == {"cuda:0"}
    tol = 1e-4 if compression == "none" else 3e-2
    assert_close_params(result.model, sgd_reference(spec, parts), tol)


class _FakeContext:
    master = "local[2]"

    def getConf(self):
        return {"spark.task.resource.gpu.amount": "1"}


def test_local_mode_has_no_stage_level_scheduling(caplog):
    from sparktrain.driver import gpu

    assert gpu.training_profile(ClassicEnv(_FakeContext()), TrainConfig(gpus_per_task=0)) is None
    with caplog.at_level("WARNING", logger="sparktrain.driver.gpu"):
        assert (
            gpu.training_profile(ClassicEnv(_FakeContext()), TrainConfig(gpus_per_task=1)) is None
        )
    assert "no stage-level scheduling" in caplog.text
    assert "spark.task.resource.gpu.amount=1" in caplog.text


def test_too_few_gpu_slots_names_the_gpus():
    from sparktrain.driver.resources import too_few_slots

    msg = too_few_slots(ClassicEnv(_FakeContext()), 3, 2, profile_id=1)  # type: ignore[arg-type]
    assert "resource profile 1" in msg and "spark.executor.resource.gpu.amount" in msg


class _ConnectConf:
    def get(self, key, default=None):
        return {"spark.master": "spark://10.0.0.1:7077"}.get(key, default)


class _ConnectSession:
    conf = _ConnectConf()


def test_gpus_per_task_under_connect_says_how_to_give_tasks_gpus():
    from sparktrain.driver import gpu
    from sparktrain.driver.spark_env import ConnectEnv

    env = ConnectEnv(_ConnectSession())
    assert env.slots(profile_id=3) is None  # a Connect client cannot count a profile's slots
    with pytest.raises(ConfigError, match="spark.task.resource.gpu.amount"):
        gpu.training_profile(env, TrainConfig(gpus_per_task=1))
