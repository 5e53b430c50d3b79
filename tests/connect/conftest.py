"""One Spark Connect server for every ``connect`` test of a run (started on first use,
stopped at the end of the session, also when a test or the start itself fails)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .fixtures import ConnectServer, client_session, connect_mode, java_missing


@pytest.fixture(scope="session")
def connect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ConnectServer]:
    """pyspark's Connect server on 127.0.0.1 (a free port, local[2]); skipped only when
    Java is missing."""
    reason = java_missing()
    if reason:
        pytest.skip(reason)
    workdir: Path = tmp_path_factory.mktemp("connect-server")
    with ConnectServer(workdir) as server:
        yield server


@pytest.fixture(scope="session")
def connect_spark(connect_server: ConnectServer) -> Iterator[Any]:
    """A client session of the shared server (``SparkSession.builder.remote(url)``)."""
    session = client_session(connect_server.url)
    try:
        yield session
    finally:
        if connect_server.running():  # a dead server would keep the client retrying
            with connect_mode():
                session.stop()


@pytest.fixture(autouse=True)
def _connect_mode() -> Iterator[None]:
    """pyspark's Connect switch on while a connect test runs, off again after it (see
    tests/connect/fixtures.py)."""
    with connect_mode():
        yield
