"""PySpark's accumulator server off loopback TCP (issue 31, point 3): the sessions
sparktrain builds set ``spark.python.unix.domain.socket.enabled``, and a session of the
user's own whose accumulator server is a TCP listener gets one warning that names it.

No JVM: the builder is a recording stand-in, and the servers are pyspark's own classes
(:class:`pyspark.accumulators.AccumulatorTCPServer` and ``AccumulatorUnixServer``), made
without serving. The attack itself is tests/integration/test_accumulator_attack.py.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pyspark.accumulators import AccumulatorTCPServer, AccumulatorUnixServer, UpdateRequestHandler

from sparktrain import session as session_module
from sparktrain.driver import spark_env as spark_env_module
from sparktrain.driver.spark_env import (
    UNIX_SOCKETS,
    spark_env,
    tcp_accumulator_address,
    warn_tcp_accumulator,
)


class _Context:
    """The parts of a SparkContext that the session start and spark_env() touch."""

    def __init__(self, server: Any = None) -> None:
        self._accumulatorServer = server
        self.master = "local[2]"

    def setLogLevel(self, level: str) -> None:
        pass


class _Session:
    def __init__(self, sc: _Context) -> None:
        self.sparkContext = sc


class _Builder:
    """Records what get_or_create_session configures."""

    def __init__(self) -> None:
        self.conf: dict[str, str] = {}

    def appName(self, name: str) -> _Builder:
        return self

    def master(self, master: str) -> _Builder:
        return self

    def config(self, key: str, value: str) -> _Builder:
        self.conf[key] = value
        return self

    def getOrCreate(self) -> _Session:
        return _Session(_Context())


@pytest.fixture
def builder(monkeypatch: pytest.MonkeyPatch) -> _Builder:
    from pyspark.sql import SparkSession

    recording = _Builder()
    monkeypatch.setattr(SparkSession, "builder", recording)
    monkeypatch.setattr(SparkSession, "getActiveSession", staticmethod(lambda: None))
    monkeypatch.setattr(session_module, "PRELOAD", ())  # no imports in the background
    return recording


@pytest.fixture
def tcp_server() -> Iterator[AccumulatorTCPServer]:
    server = AccumulatorTCPServer(("localhost", 0), UpdateRequestHandler, "token")
    try:
        yield server
    finally:
        server.server_close()


@pytest.fixture
def unix_server() -> Iterator[Any]:
    with tempfile.TemporaryDirectory() as tmp:
        server = AccumulatorUnixServer(os.path.join(tmp, "acc.sock"), UpdateRequestHandler)
        try:
            yield server
        finally:
            server.server_close()


@pytest.fixture
def fresh_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spark_env_module, "_tcp_warned", False)


def test_sessions_we_build_put_the_accumulator_server_on_a_unix_socket(builder: _Builder) -> None:
    # the CLI, jobs/*.py, the benches and tests/conftest.py all start sessions this way
    session_module.get_or_create_session(
        "local[2]", conf={"spark.task.maxFailures": "1"}, warm_workers=False
    )
    assert builder.conf[UNIX_SOCKETS] == "true"
    assert session_module.DEFAULTS[UNIX_SOCKETS] == "true"


def test_a_caller_may_still_turn_it_off(builder: _Builder) -> None:
    session_module.get_or_create_session(
        "local[2]", conf={UNIX_SOCKETS: "false"}, warm_workers=False
    )
    assert builder.conf[UNIX_SOCKETS] == "false"


def test_spark_defaults_conf_sets_it_too() -> None:
    conf = Path(__file__).resolve().parents[2] / "conf" / "spark-defaults.conf"
    lines = [line.split() for line in conf.read_text().splitlines() if line.strip()]
    assert [UNIX_SOCKETS, "true"] in lines


def test_the_address_tells_a_tcp_server_from_a_unix_one(
    tcp_server: AccumulatorTCPServer, unix_server: Any
) -> None:
    host, port = tcp_server.server_address[:2]
    assert tcp_accumulator_address(_Context(tcp_server)) == (host, port)
    assert tcp_accumulator_address(_Context(unix_server)) is None
    assert tcp_accumulator_address(_Context(None)) is None


@pytest.mark.usefixtures("fresh_warning")
def test_a_tcp_accumulator_server_gets_one_warning_that_names_the_setting(
    tcp_server: AccumulatorTCPServer, caplog: pytest.LogCaptureFixture
) -> None:
    session = _Session(_Context(tcp_server))
    with caplog.at_level(logging.WARNING, logger="sparktrain.driver.spark_env"):
        spark_env(session)  # what every fit asks for first
        spark_env(session)
        assert warn_tcp_accumulator(session.sparkContext) is False
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert f"{UNIX_SOCKETS}=true" in warnings[0]
    assert f"TCP {tcp_server.server_address[0]}:{tcp_server.server_address[1]}" in warnings[0]


@pytest.mark.usefixtures("fresh_warning")
def test_a_unix_accumulator_server_gets_no_warning(
    unix_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="sparktrain.driver.spark_env"):
        spark_env(_Session(_Context(unix_server)))
        assert warn_tcp_accumulator(_Context(unix_server)) is False
    assert not caplog.records
