"""TorchDistributor's argument checks and torch_run's keywords, scripts and return values,
without Spark: a stand-in session answers ``SparkSession.active()``."""

from __future__ import annotations

import collections
import json
import os
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import sparktrain
from sparktrain import TrainConfig, errors
from sparktrain.distributor import (
    check_return_annotation,
    is_plain,
    run_script,
    script_path,
    torch_run,
    unwrap_value,
    wrap_value,
)
from sparktrain.torch_distributor import TorchDistributor


class _Gpu:
    def __init__(self, addresses: list[str]) -> None:
        self.addresses = addresses


class _Session:
    """What TorchDistributor reads of a SparkSession: conf and the driver's resources."""

    def __init__(self, conf: dict[str, str] | None = None, gpus: list[str] | None = None):
        self.conf = self
        self._conf = conf or {}
        self.sparkContext = self
        self.resources = {} if gpus is None else {"gpu": _Gpu(gpus)}

    def get(self, key: str, default: str) -> str:
        return self._conf.get(key, default)


@pytest.fixture
def session(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Session]:
    from pyspark.sql import SparkSession

    fake = _Session()
    monkeypatch.setattr(SparkSession, "active", classmethod(lambda cls: fake))
    yield fake


def test_exported_from_the_package() -> None:
    assert sparktrain.TorchDistributor is TorchDistributor
    assert "TorchDistributor" in sparktrain.__all__


# ---- the constructor: pyspark's checks and messages ----


def test_defaults_match_pyspark(session: _Session) -> None:
    import inspect

    from pyspark.ml.torch.distributor import TorchDistributor as Pyspark

    ours = inspect.signature(TorchDistributor.__init__).parameters
    theirs = inspect.signature(Pyspark.__init__).parameters
    for name in ("num_processes", "local_mode", "use_gpu"):
        assert ours[name].default == theirs[name].default


@pytest.mark.parametrize("n", [0, -1])
def test_num_processes_must_be_positive(session: _Session, n: int) -> None:
    with pytest.raises(ValueError, match="num_processes has to be a positive integer"):
        TorchDistributor(num_processes=n, local_mode=True, use_gpu=False)


def test_use_gpu_local_without_driver_gpus(session: _Session) -> None:
    with pytest.raises(RuntimeError, match="GPUs were unable to be found on the driver"):
        TorchDistributor(num_processes=2, local_mode=True, use_gpu=True)


def test_use_gpu_local_without_driver_amount(session: _Session) -> None:
    session.resources = {"gpu": _Gpu(["0", "1"])}
    with pytest.raises(RuntimeError, match="not configured properly on the driver"):
        TorchDistributor(num_processes=2, local_mode=True, use_gpu=True)


def test_use_gpu_local_caps_processes_at_driver_gpus(session: _Session) -> None:
    session.resources = {"gpu": _Gpu(["0", "1"])}
    session._conf["spark.driver.resource.gpu.amount"] = "2"
    dist = TorchDistributor(num_processes=4, local_mode=True, use_gpu=True)
    assert dist.num_processes == 2


def test_use_gpu_distributed_without_task_amount(session: _Session) -> None:
    with pytest.raises(RuntimeError, match="'spark.task.resource.gpu.amount' was unset"):
        TorchDistributor(num_processes=2, local_mode=False, use_gpu=True)


@pytest.mark.parametrize(("amount", "n", "tasks"), [("1", 3, 3), ("2", 4, 2), ("3", 6, 2)])
def test_use_gpu_distributed_tasks(session: _Session, amount: str, n: int, tasks: int) -> None:
    session._conf["spark.task.resource.gpu.amount"] = amount
    assert TorchDistributor(num_processes=n, local_mode=False, use_gpu=True).num_tasks == tasks


def test_use_gpu_distributed_not_a_multiple(session: _Session) -> None:
    session._conf["spark.task.resource.gpu.amount"] = "2"
    with pytest.raises(RuntimeError, match=r"must be a multiple of"):
        TorchDistributor(num_processes=3, local_mode=False, use_gpu=True)


def test_cpu_tasks_are_processes(session: _Session) -> None:
    assert TorchDistributor(num_processes=3, local_mode=False, use_gpu=False).num_tasks == 3


def test_script_with_keywords_refused(session: _Session, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    dist = TorchDistributor(num_processes=1, local_mode=True, use_gpu=False)
    with pytest.raises(ValueError, match="does not support key-word type arguments"):
        dist.run(str(script), lr=0.1)


def test_missing_script_named_on_the_driver(session: _Session, tmp_path: Path) -> None:
    dist = TorchDistributor(num_processes=1, local_mode=True, use_gpu=False)
    with pytest.raises(FileNotFoundError, match=r"not a file on the driver"):
        dist.run(str(tmp_path / "nope.py"), "--lr", "0.1")


def test_generator_return_refused_before_training(session: _Session) -> None:
    def train() -> Iterator[int]:
        raise AssertionError("must not run")

    dist = TorchDistributor(num_processes=1, local_mode=True, use_gpu=False)
    with pytest.raises(TypeError, match="cannot travel back"):
        dist.run(train)


ENV_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
            "MASTER_PORT", "CUDA_VISIBLE_DEVICES"]
    out = os.path.join(sys.argv[1], os.environ["RANK"] + ".json")
    with open(out, "w") as f:
        json.dump({"env": {k: os.environ.get(k) for k in keys}, "argv": sys.argv[2:]}, f)
    """
)


@pytest.mark.timeout(60)  # two plain Python processes (no torch import)
def test_local_script_runs_on_every_rank(session: _Session, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(ENV_SCRIPT)
    dist = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False)
    assert dist.run(str(script), str(tmp_path), "--lr", 0.1) is None
    seen = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    for rank, got in enumerate(seen):
        env = got["env"]
        assert got["argv"] == ["--lr", "0.1"]
        assert (env["RANK"], env["WORLD_SIZE"]) == (str(rank), "2")
        assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == (str(rank), "2")
        assert env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0
        assert env["CUDA_VISIBLE_DEVICES"] == os.environ.get("CUDA_VISIBLE_DEVICES")


@pytest.mark.timeout(60)  # one plain Python process
def test_local_script_failure_raises(session: _Session, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("import sys; sys.exit(3)\n")
    dist = TorchDistributor(num_processes=1, local_mode=True, use_gpu=False)
    with pytest.raises(RuntimeError, match="rank 0 exited with code 3"):
        dist.run(str(script))


# ---- torch_run: keywords ----


def test_torch_run_keyword_collision_refused() -> None:
    def train(config: dict[str, Any]) -> None:
        raise AssertionError("must not run")

    with pytest.raises(TypeError, match=r"ambiguous.*TorchDistributor"):
        torch_run(train, config=TrainConfig(num_workers=1))


def test_torch_run_config_must_be_a_train_config() -> None:
    def train(**kwargs: Any) -> None:
        raise AssertionError("must not run")

    with pytest.raises(TypeError, match="takes a sparktrain.TrainConfig"):
        torch_run(train, config={"lr": 1})  # type: ignore[arg-type]


def test_script_path_checks() -> None:
    with pytest.raises(FileNotFoundError, match="not a file on the driver"):
        script_path("/nonexistent/train.py", {})
    with pytest.raises(ValueError, match="key-word"):
        script_path(__file__, {"lr": 1})
    assert script_path(os.path.relpath(__file__), {}) == os.path.abspath(__file__)


@pytest.mark.timeout(60)  # one plain Python process
def test_run_script_failure_names_rank(tmp_path: Path) -> None:
    script = tmp_path / "t.py"
    script.write_text("import sys; sys.exit(2)\n")
    with pytest.raises(RuntimeError, match=r"rank 1: .* exited with code 2"):
        run_script(str(script), [], rank=1)


# ---- return values ----


class Custom:
    def __init__(self, x: int) -> None:
        self.x = x


@pytest.mark.parametrize(
    "value",
    [
        {1: "a", 2: "b"},
        Custom(3),
        torch.nn.Linear(2, 1),
        collections.OrderedDict(a=(1, 2)),
        {"__sparktrain_pickled__": 1},
    ],
)
def test_pickled_value_round_trip(value: Any) -> None:
    key = os.urandom(32)
    wire = wrap_value(value, key, streamed=True)
    back = unwrap_value(wire, key)
    assert type(back) is type(value)
    if isinstance(value, torch.nn.Linear):
        assert torch.equal(back.weight, value.weight)
    elif isinstance(value, Custom):
        assert back.x == 3
    else:
        assert back == value


def test_plain_values_stay_unpickled() -> None:
    value = {"w": torch.ones(2), "n": [1, 2.0, "x", None]}
    assert is_plain(value)
    assert wrap_value(value, b"k" * 32, streamed=False) is value


def test_no_pickle_where_the_channel_is_not_authenticated() -> None:
    with pytest.raises(errors.ConfigError, match="does not authenticate"):
        wrap_value({1: 2}, b"k" * 32, streamed=False)


def test_unsigned_pickle_refused() -> None:
    wire = wrap_value(Custom(1), os.urandom(32), streamed=True)
    with pytest.raises(errors.HandshakeError, match="signature"):
        unwrap_value(wire, os.urandom(32))


def test_return_annotation_checks() -> None:
    def gen() -> Iterator[int]:
        yield 1

    def fine() -> dict[int, str]:
        return {}

    with pytest.raises(TypeError, match="cannot travel back"):
        check_return_annotation(gen)
    check_return_annotation(fine)
