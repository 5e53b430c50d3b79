"""``sparktrain.TorchDistributor`` and ``torch_run``'s TorchDistributor features through a
real Spark (local[2]): keywords to the function, Python files run on every rank, values
only pickle carries coming back, the rank variables, local mode on the driver, and the
GPU checks of pyspark's TorchDistributor (this machine has no GPU)."""

from __future__ import annotations

import json
import os
import textwrap
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

import sparktrain
from sparktrain import TorchDistributor, TrainConfig
from sparktrain.driver import occupancy
from tests.integration.fixtures import bounded

RANK_TIMEOUT_S = 60.0
"""A rank's ``init_process_group`` timeout: a peer that never comes fails the call in time."""


class Result:
    """A custom object only pickle carries back."""

    def __init__(self, world: int, total: float) -> None:
        self.world, self.total = world, total


def allreduce(scale: float, *, tol: float, max_iter: int) -> dict[str, Any]:
    """A TorchDistributor function with keywords: one all_reduce over Gloo."""
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=RANK_TIMEOUT_S))
    t = torch.tensor([scale * (dist.get_rank() + 1)])
    dist.all_reduce(t)
    env = {
        k: os.environ.get(k)
        for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES", "WORLD_SIZE")
    }
    dist.destroy_process_group()
    return {"tol": tol, "max_iter": max_iter, "sum": float(t), "env": env}


def pickled_values(scale: float, kind: str = "int_keys") -> Any:
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=RANK_TIMEOUT_S))
    t = torch.tensor([scale])
    dist.all_reduce(t)
    world = dist.get_world_size()
    dist.destroy_process_group()
    if kind == "int_keys":
        return {0: "zero", world: float(t)}
    if kind == "module":
        torch.manual_seed(0)
        return torch.nn.Linear(3, 1)
    return Result(world, float(t))


ENV_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch.distributed as dist
    dist.init_process_group("gloo")  # env://, as under torchrun
    keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES"]
    out = os.path.join(sys.argv[1], os.environ["RANK"] + ".json")
    with open(out, "w") as f:
        json.dump({"env": {k: os.environ.get(k) for k in keys}, "argv": sys.argv[2:],
                   "world": dist.get_world_size()}, f)
    dist.destroy_process_group()
    """
)


def cfg(**overrides: Any) -> TrainConfig:
    return TrainConfig(**{"progress": False, "comm_timeout": 30.0, **overrides})


# each waits for one or two 2-task barrier stages on local[2] (a stage that cannot start
# waits for its slots without end; bounded() cancels it first)
@pytest.mark.timeout(150, func_only=True)
def test_torch_run_passes_keywords(spark):  # type: ignore[no-untyped-def]
    with bounded(spark, 120):
        out = sparktrain.torch_run(
            allreduce, 2.0, tol=1e-3, max_iter=64, num_workers=2, config=cfg(), spark=spark
        )
    assert (out["tol"], out["max_iter"], out["sum"]) == (1e-3, 64, 6.0)


@pytest.mark.timeout(150, func_only=True)  # one 2-task barrier stage on local[2]
def test_distributor_run_keywords_and_rank_variables(spark):  # type: ignore[no-untyped-def]
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    dist = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False)
    with bounded(spark, 120):
        out = dist.run(allreduce, 1.0, tol=0.5, max_iter=3)
    assert (out["tol"], out["max_iter"], out["sum"]) == (0.5, 3, 3.0)
    # both tasks of local[2] share one host: torchrun's meaning of the local variables
    assert out["env"] == {
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "2",
        "CUDA_VISIBLE_DEVICES": "",  # use_gpu=False hides the GPUs, as pyspark does
        "WORLD_SIZE": "2",
    }
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == before  # the driver's is untouched


@pytest.mark.timeout(170, func_only=True)  # three 2-task barrier stages on local[2]
def test_values_only_pickle_carries_come_back(spark):  # type: ignore[no-untyped-def]
    dist = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False)
    with bounded(spark, 150):
        assert dist.run(pickled_values, 1.5) == {0: "zero", 2: 3.0}
        module = dist.run(pickled_values, 1.0, kind="module")
        custom = dist.run(pickled_values, 1.0, kind="custom")
    torch.manual_seed(0)
    assert torch.equal(module.weight, torch.nn.Linear(3, 1).weight)
    assert isinstance(custom, Result) and (custom.world, custom.total) == (2, 2.0)


@pytest.mark.timeout(150, func_only=True)  # one 2-task barrier stage running a script
def test_script_runs_on_every_task(spark, tmp_path: Path):  # type: ignore[no-untyped-def]
    script = tmp_path / "train.py"
    script.write_text(ENV_SCRIPT)
    dist = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False)
    with bounded(spark, 120):
        assert dist.run(str(script), str(tmp_path), "--lr", "0.1") is None
    seen = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    for rank, got in enumerate(seen):
        assert got["argv"] == ["--lr", "0.1"] and got["world"] == 2
        assert got["env"]["RANK"] == str(rank) and got["env"]["CUDA_VISIBLE_DEVICES"] == ""
    assert sorted(g["env"]["LOCAL_RANK"] for g in seen) == ["0", "1"]


@pytest.mark.timeout(150, func_only=True)  # a failing script's 1-task stage
def test_failing_script_fails_the_run(spark, tmp_path: Path):  # type: ignore[no-untyped-def]
    script = tmp_path / "train.py"
    script.write_text("import sys; sys.exit(5)\n")
    with bounded(spark, 120), pytest.raises(Exception, match="exited with code 5"):
        sparktrain.torch_run(str(script), num_workers=1, config=cfg(max_restarts=0), spark=spark)
    assert occupancy.running_tasks(spark.sparkContext) == 0


@pytest.mark.timeout(60, func_only=True)  # nothing: refused on the driver before a stage
def test_missing_script_is_refused_on_the_driver(spark, tmp_path: Path):  # type: ignore[no-untyped-def]
    dist = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False)
    with pytest.raises(FileNotFoundError, match="not a file on the driver"):
        dist.run(str(tmp_path / "missing.py"), "--lr", "0.1")


@pytest.mark.timeout(120, func_only=True)  # two processes on the driver importing torch
def test_local_mode_runs_processes_on_the_driver(spark):  # type: ignore[no-untyped-def]
    dist = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False)
    assert dist.run(pickled_values, 2.0, kind="int_keys") == {0: "zero", 2: 4.0}
    out = dist.run(allreduce, 1.0, tol=0.1, max_iter=7)
    assert (out["tol"], out["max_iter"], out["sum"]) == (0.1, 7, 3.0)
    assert (out["env"]["LOCAL_RANK"], out["env"]["LOCAL_WORLD_SIZE"]) == ("0", "2")
    assert occupancy.running_tasks(spark.sparkContext) == 0


@pytest.mark.timeout(60, func_only=True)  # nothing: the constructor's checks
def test_use_gpu_without_gpus_fails_as_pyspark(spark):  # type: ignore[no-untyped-def]
    with pytest.raises(RuntimeError, match="GPUs were unable to be found on the driver"):
        TorchDistributor(num_processes=1, local_mode=True, use_gpu=True)
    with pytest.raises(RuntimeError, match="'spark.task.resource.gpu.amount' was unset"):
        TorchDistributor(num_processes=1, local_mode=False, use_gpu=True)
    with pytest.raises(ValueError, match="num_processes has to be a positive integer"):
        TorchDistributor(num_processes=0, local_mode=True, use_gpu=False)
