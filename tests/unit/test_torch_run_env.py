"""The environment ``sparktrain.torch_run`` gives ``fn``, its restoration, the free
port, and the refusal when encryption is required."""

from __future__ import annotations

import os
import socket

import pytest

from sparktrain import TrainConfig
from sparktrain.distributor import (
    ENV_KEYS,
    TorchEntry,
    check_torch_transport,
    free_port,
    patched_env,
    torch_env,
)
from sparktrain.errors import ResourceError


def test_env_of_each_rank_on_two_hosts() -> None:
    hosts = ["10.0.0.1", "10.0.0.2", "10.0.0.1", "10.0.0.2", "10.0.0.1"]
    envs = [torch_env(r, hosts, 29500) for r in range(5)]
    assert all(set(e) == set(ENV_KEYS) for e in envs)
    assert [e["RANK"] for e in envs] == ["0", "1", "2", "3", "4"]
    assert {e["WORLD_SIZE"] for e in envs} == {"5"}
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "0", "1", "1", "2"]
    assert [e["LOCAL_WORLD_SIZE"] for e in envs] == ["3", "2", "3", "2", "3"]
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs} == {("10.0.0.1", "29500")}


def test_env_refuses_a_bad_rank_or_port() -> None:
    with pytest.raises(ValueError, match="rank 2"):
        torch_env(2, ["a", "b"], 1)
    with pytest.raises(ValueError, match="not a port"):
        torch_env(0, ["a"], 0)


def test_patched_env_restores_set_and_unset_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "7")
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(RuntimeError), patched_env({"RANK": "0", "MASTER_PORT": "1234"}):
        assert os.environ["RANK"] == "0" and os.environ["MASTER_PORT"] == "1234"
        raise RuntimeError("fn failed")
    assert os.environ["RANK"] == "7"
    assert "MASTER_PORT" not in os.environ


def test_free_port_is_bindable_on_that_address() -> None:
    port = free_port("127.0.0.1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


class _Task:
    host = "127.0.0.1"

    def __init__(self, rank: int, gathered: list[str]) -> None:
        self.rank, self.gathered = rank, gathered

    def all_gather(self, message: str) -> list[str]:
        self.gathered.insert(self.rank, message)
        return self.gathered


class _Ctx:
    def __init__(self, rank: int, gathered: list[str]) -> None:
        self.rank = rank
        self.task = _Task(rank, gathered)


def test_entry_calls_fn_with_the_env_from_the_all_gather() -> None:
    seen: dict[str, str] = {}

    def fn(a: int, b: int) -> int:
        seen.update({k: os.environ[k] for k in ENV_KEYS})
        return a + b

    rank0 = '{"host": "127.0.0.2", "port": 4321}'
    assert TorchEntry(fn, (1, 2))(_Ctx(1, [rank0])) == 3  # type: ignore[arg-type]
    assert seen["RANK"] == "1" and seen["WORLD_SIZE"] == "2"
    assert seen["MASTER_ADDR"] == "127.0.0.2" and seen["MASTER_PORT"] == "4321"
    assert seen["LOCAL_RANK"] == "0" and seen["LOCAL_WORLD_SIZE"] == "1"


def test_refused_when_encryption_is_required() -> None:
    with pytest.raises(ResourceError, match="neither authenticated nor encrypted"):
        check_torch_transport([], TrainConfig(encryption="tls"), "torch_run")
    wire = ["spark.network.crypto.enabled"]
    with pytest.raises(ResourceError, match="allow_unencrypted"):
        check_torch_transport(wire, TrainConfig(), "torch_run")
    check_torch_transport(wire, TrainConfig(allow_unencrypted=True), "torch_run")
    check_torch_transport([], TrainConfig(), "torch_run")


def test_torch_run_refuses_the_parameter_server() -> None:
    from sparktrain.distributor import torch_run
    from sparktrain.errors import ConfigError

    with pytest.raises(ConfigError, match="strategy='ring' or 'tree'"):
        torch_run(print, config=TrainConfig(strategy="ps"), spark=object())  # type: ignore[arg-type]


def test_sparktrain_torch_run_is_the_function_after_its_module_is_imported() -> None:
    import sparktrain
    import sparktrain.distributor

    assert sparktrain.torch_run is sparktrain.distributor.torch_run
