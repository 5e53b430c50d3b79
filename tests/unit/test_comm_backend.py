"""``comm_backend``: validation, the DDP hook each spec maps to, the refusals when
encryption is required, and the encryption gate asking for them."""

from __future__ import annotations

import pytest

from sparktrain import TrainConfig
from sparktrain.comm_backend import HookSpec, hook_spec
from sparktrain.driver.job import check_job
from sparktrain.driver.resources import check_transport_security
from sparktrain.driver.spark_env import ClassicEnv
from sparktrain.errors import ConfigError, ResourceError


def test_default_and_unknown() -> None:
    assert TrainConfig().comm_backend == "sparktrain"
    with pytest.raises(ConfigError, match="comm_backend='nccl' is not allowed"):
        TrainConfig(comm_backend="nccl")
    assert TrainConfig.from_dict({"comm_backend": "torch"}).comm_backend == "torch"


@pytest.mark.parametrize("strategy", ["ps", "tree_aggregate", "auto"])
def test_torch_only_for_ring_and_tree(strategy: str) -> None:
    with pytest.raises(ConfigError, match="strategy='ring' or 'tree'"):
        check_job(TrainConfig(comm_backend="torch", strategy=strategy))


def test_torch_refuses_tls() -> None:
    with pytest.raises(ConfigError, match="neither authenticated nor encrypted"):
        TrainConfig(comm_backend="torch", encryption="tls")


def test_hook_specs() -> None:
    assert hook_spec("none") is None
    assert hook_spec("fp16") == HookSpec("fp16")
    assert hook_spec("bf16") == HookSpec("bf16")
    assert hook_spec("powersgd:2") == HookSpec("powersgd", rank=2)
    assert hook_spec("powersgd:4,cold+ef") == HookSpec(
        "powersgd", rank=4, warm_start=False, error_feedback=True
    )
    for spec in ("int8", "topk:0.01+ef", "sign", "delta+fp16", "fp16+ef"):
        with pytest.raises(ConfigError, match="no counterpart"):
            hook_spec(spec)
    with pytest.raises(ConfigError, match="no counterpart for compression='int8'"):
        TrainConfig(comm_backend="torch", compression={"*": "int8"})
    TrainConfig(comm_backend="torch", compression={"fc*": "fp16", "*": "powersgd:1+ef"})


class _Conf:
    def __init__(self, values: dict[str, str]) -> None:
        self.values = values

    def get(self, key: str, default: str) -> str:
        return self.values.get(key, default)


class _Sc:
    def __init__(self, **values: str) -> None:
        self.conf = _Conf(values)

    def getConf(self) -> _Conf:
        return self.conf


def test_the_gate_refuses_torch_when_spark_encrypts() -> None:
    env = ClassicEnv(_Sc(**{"spark.ssl.rpc.enabled": "true"}))  # type: ignore[arg-type]
    with pytest.raises(ResourceError, match="comm_backend='torch' sends through torch"):
        check_transport_security(env, TrainConfig(comm_backend="torch"))
    ok = TrainConfig(comm_backend="torch", allow_unencrypted=True)
    assert check_transport_security(env, ok).frame_integrity
    plain = ClassicEnv(_Sc())  # type: ignore[arg-type]
    assert check_transport_security(plain, TrainConfig(comm_backend="torch")).comm_backend
