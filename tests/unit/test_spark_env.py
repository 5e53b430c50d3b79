"""The driver's view of Spark without Spark: telling a Connect session from a classic one,
counting slots from a master and a conf, byte sizes, the Connect env's confs, tags and
refusals, the launch checks under Connect, where a Connect client saves weights, and
how transform ships them."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest

from sparktrain.config import TrainConfig
from sparktrain.driver.resources import check_can_launch, check_transport_security
from sparktrain.driver.spark_env import (
    CONNECT_MAX_MESSAGE,
    ClassicEnv,
    ConnectEnv,
    check_data_kind,
    is_connect,
    is_local_master,
    is_loopback,
    parse_bytes,
    slots_from_conf,
    spark_env,
)
from sparktrain.errors import CommError, ConfigError, DataError, ResourceError
from sparktrain.ml.model import InlineWeights, ship_weights, unship_weights
from sparktrain.ml.persistence import _write_local, connect_local_path
from sparktrain.task.payload_client import ServedBytes


class _Conf:
    def __init__(self, values: dict[str, str], fail: bool = False) -> None:
        self.values, self.fail = values, fail

    def get(self, key: str, default: str | None = None) -> str | None:
        if self.fail:
            raise PermissionError(f"{key} is not visible to this client")
        return self.values.get(key, default)


class _Session:
    """Stands in for pyspark.sql.connect.session.SparkSession (by its module's name)."""

    def __init__(self, conf: dict[str, str] | None = None, fail: bool = False) -> None:
        self.conf = _Conf({"spark.master": "local[2]", **(conf or {})}, fail)
        self.tags: list[str] = []
        self.interrupted: list[str] = []

    def addTag(self, tag: str) -> None:
        self.tags.append(tag)

    def removeTag(self, tag: str) -> None:
        self.tags.remove(tag)

    def interruptTag(self, tag: str) -> None:
        self.interrupted.append(tag)


_Session.__module__ = "pyspark.sql.connect.session"


class _ClassicContext:
    master = "local[2]"

    def __init__(self) -> None:
        self.broadcasts: list[bytes] = []

    def getConf(self) -> _Conf:
        return _Conf({})

    def broadcast(self, value: bytes) -> str:
        self.broadcasts.append(value)
        return "a broadcast"


class _ClassicSession:
    def __init__(self) -> None:
        self.sparkContext = _ClassicContext()


def test_a_connect_session_is_told_by_its_class_not_by_the_process():
    assert is_connect(_Session()) and isinstance(spark_env(_Session()), ConnectEnv)
    classic = _ClassicSession()
    assert not is_connect(classic) and isinstance(spark_env(classic), ClassicEnv)


@pytest.mark.parametrize(
    ("master", "conf", "host_cpus", "slots"),
    [
        ("local", {}, None, 1),
        ("local[2]", {}, None, 2),
        ("local[3,4]", {}, None, 3),  # the second figure is retries, not cores
        ("local[4]", {"spark.task.cpus": "2"}, None, 2),
        ("local[*]", {}, 8, 8),
        ("local[*]", {}, None, None),  # the server's cores were not counted
        ("local-cluster[2,1,1024]", {}, None, 2),
        ("local-cluster[3, 2, 512]", {"spark.task.cpus": "2"}, None, 3),
        (
            "spark://h:7077",
            {"spark.executor.instances": "3", "spark.executor.cores": "4"},
            None,
            12,
        ),
        ("yarn", {"spark.executor.cores": "4"}, None, None),  # dynamic or unknown
        ("k8s://https://h:6443", {}, None, None),
    ],
)
def test_slots_from_the_master_and_the_conf(master, conf, host_cpus, slots):  # type: ignore[no-untyped-def]
    assert slots_from_conf(master, conf, host_cpus) == slots


def test_local_masters():
    assert all(is_local_master(m) for m in ("local", "local[2]", "local[*]", "local[2,3]"))
    assert not any(is_local_master(m) for m in ("local-cluster[2,1,1024]", "yarn", "spark://h:1"))


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("134217728", 128 << 20),
        ("128m", 128 << 20),
        ("128mb", 128 << 20),
        ("1g", 1 << 30),
        ("64k", 64 << 10),
        ("1GiB", 1 << 30),
        (" 7 ", 7),
    ],
)
def test_byte_sizes_read_as_spark_does(text, value):  # type: ignore[no-untyped-def]
    assert parse_bytes(text) == value


def test_a_byte_size_that_is_not_one_fails():
    with pytest.raises(ValueError, match="not a byte size"):
        parse_bytes("lots")


def test_loopback_hosts():
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.8.9.1", "localhost", "::1", "[::1]"))
    assert not any(is_loopback(h) for h in ("10.0.0.1", "example.com", "0.0.0.0"))


def test_the_connect_env_reads_spark_conf_and_counts_configured_slots():
    env = ConnectEnv(_Session({"spark.task.cpus": "2", "spark.driver.host": "127.0.0.1"}))
    assert env.connect and env.master == "local[2]" and env.is_local()
    assert env.task_cpus() == 2 and env.slots() == 1 and not env.watches_slots
    assert env.driver_host() == "127.0.0.1"  # no URL known: the driver's own host
    assert env.max_request_bytes() == CONNECT_MAX_MESSAGE
    env = ConnectEnv(_Session({"spark.connect.grpc.maxInboundMessageSize": "64m"}))
    assert env.max_request_bytes() == 64 << 20


def test_a_connect_job_group_is_a_tag_removed_afterwards_even_on_failure():
    session = _Session()
    env = ConnectEnv(session)
    with pytest.raises(RuntimeError), env.job_group("sparktrain-x-0", "training stage"):
        assert session.tags == ["sparktrain-x-0"]
        raise RuntimeError("the stage failed")
    assert session.tags == []
    env.cancel_group("sparktrain-x-0")
    assert session.interrupted == ["sparktrain-x-0"]


def test_connect_has_no_spark_context_and_says_what_works():
    with pytest.raises(ConfigError, match="'ring', 'tree' or 'ps'"):
        ConnectEnv(_Session()).spark_context("strategy='tree_aggregate'")


def test_slots_a_connect_client_cannot_count_are_logged_as_not_checked(caplog):  # type: ignore[no-untyped-def]
    caplog.set_level(logging.INFO, logger="sparktrain.driver.resources")
    check_can_launch(ConnectEnv(_Session({"spark.master": "yarn"})), 2)
    assert "cannot count the task slots of master 'yarn'" in caplog.text


def test_too_few_configured_slots_fail_at_once_under_connect():
    with pytest.raises(ResourceError, match="num_workers=4 needs 4 task slots"):
        check_can_launch(ConnectEnv(_Session()), 4, wait_for_executors_s=60.0)


def test_dynamic_allocation_is_refused_under_connect_too():
    env = ConnectEnv(_Session({"spark.dynamicAllocation.enabled": "true"}))
    with pytest.raises(ResourceError, match="dynamic allocation"):
        check_can_launch(env, 2)


def test_the_encryption_gate_reads_spark_conf_under_connect():
    env = ConnectEnv(_Session({"spark.network.crypto.enabled": "true"}))
    with pytest.raises(ResourceError, match="spark.network.crypto.enabled=true"):
        check_transport_security(env, TrainConfig())


def test_encryption_settings_a_connect_server_hides_are_said_to_be_unchecked(caplog):  # type: ignore[no-untyped-def]
    cfg = TrainConfig()
    assert check_transport_security(ConnectEnv(_Session(fail=True)), cfg) is cfg
    assert "encryption gate is not applied" in caplog.text


def test_an_rdd_is_refused_under_connect_only():
    from pyspark import RDD

    rdd = RDD.__new__(RDD)
    with pytest.raises(DataError, match="no RDDs: pass a DataFrame"):
        check_data_kind(ConnectEnv(_Session()), rdd)
    check_data_kind(ConnectEnv(_Session()), None, object())
    check_data_kind(ClassicEnv(_ClassicContext()), rdd)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("path", "local"),
    [
        ("/models/digits", "/models/digits"),
        ("file:/models/digits", "/models/digits"),
        ("file:///models/digits", "/models/digits"),
        ("file://localhost/models/digits", "/models/digits"),
    ],
)
def test_connect_saves_at_absolute_local_paths(path, local):  # type: ignore[no-untyped-def]
    assert connect_local_path(path) == local


@pytest.mark.parametrize(
    "path", ["models/digits", "hdfs://nn/models", "s3a://bucket/m", "file://otherhost/m"]
)
def test_connect_refuses_paths_the_server_and_client_would_read_differently(path):  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match="absolute local path or a file: URI"):
        connect_local_path(path)


def test_local_weights_are_written_whole(tmp_path: Path):
    target = tmp_path / "m" / "data" / "weights.pt"
    _write_local(str(target), b"first")
    _write_local(str(target), b"second")
    assert target.read_bytes() == b"second"
    assert os.listdir(target.parent) == ["weights.pt"]  # no temporary file left


def test_transform_ships_small_weights_in_the_closure_under_connect():
    shipped: Any = ship_weights(ConnectEnv(_Session()), b"w" * 1000)
    assert isinstance(shipped, InlineWeights) and shipped.value == b"w" * 1000
    context = _ClassicContext()
    assert ship_weights(ClassicEnv(context), b"w") == "a broadcast"  # type: ignore[arg-type]
    assert context.broadcasts == [b"w"]


def test_weights_beyond_half_the_request_cap_are_served_not_put_in_the_plan():
    env = ConnectEnv(_Session({"spark.connect.grpc.maxInboundMessageSize": "1k"}))
    assert isinstance(ship_weights(env, b"w" * 512), InlineWeights)
    served = ship_weights(env, b"v" * 513)
    assert isinstance(served, ServedBytes) and served.nbytes == 513
    assert served.address.startswith("127.0.0.1:")  # the session's spark.driver.host default
    assert served.value == b"v" * 513  # fetched from this process's payload service
    other = ship_weights(env, b"o" * 600)  # another model's: keeps the service up
    unship_weights(served)
    with pytest.raises(CommError, match="no longer served"):
        served.value  # noqa: B018 - the read is the fetch
    unship_weights(other)  # the last payload: the service stops, nothing can reach it
    with pytest.raises(ConfigError, match="could not reach"):
        other.value  # noqa: B018


def test_a_connect_save_at_a_relative_path_is_refused_before_spark_writes_anything():
    from sparktrain.ml.model import TorchClassificationModel
    from sparktrain.ml.persistence import TorchModelWriter

    class _NoWrites(_Session):
        def createDataFrame(self, *args: Any, **kwargs: Any) -> Any:
            raise AssertionError("the metadata was written before the path was checked")

    _NoWrites.__module__ = _Session.__module__

    writer = TorchModelWriter(TorchClassificationModel()).session(_NoWrites())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="absolute local path"):
        writer.save("models/digits")


class _Builder:
    def __init__(self, host: str) -> None:
        self.host = host


class _Client:
    def __init__(self, host: str) -> None:
        self._builder = _Builder(host)


def test_driver_services_listen_where_the_executors_can_reach_this_client(monkeypatch):  # type: ignore[no-untyped-def]
    from sparktrain.driver import spark_env as module

    monkeypatch.setattr(module, "address_towards", lambda host, port: "10.9.9.9")
    session = _Session({"spark.driver.host": "10.0.0.5"})
    session.client = _Client("localhost")  # type: ignore[attr-defined]
    assert ConnectEnv(session).driver_host() == "10.0.0.5"  # the server's host: its driver
    session.client = _Client("spark.example.com")  # type: ignore[attr-defined]
    assert ConnectEnv(session).driver_host() == "10.9.9.9"  # this client, towards the server
    monkeypatch.setattr(module, "address_towards", lambda host, port: None)
    assert ConnectEnv(session).driver_host() == "10.0.0.5"  # no route: the driver's address
