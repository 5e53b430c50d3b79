"""Shared fixtures. Spark starts at most once per master, always on loopback."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

# Before anything starts a JVM or a Python worker.
os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)

_TEST_CONF = {
    "spark.barrier.sync.timeout": "120s",
    "spark.task.maxFailures": "1",
    "spark.sql.shuffle.partitions": "2",
    "spark.default.parallelism": "2",
}


class _Sessions:
    """One SparkSession at a time (one SparkContext per process); switching masters stops
    the previous one. Cluster tests are ordered last so each mode starts once."""

    def __init__(self) -> None:
        self.master: str | None = None
        self.session = None

    def get(self, master: str, conf: dict[str, str] | None = None, mode: str = ""):  # type: ignore[no-untyped-def]
        """The session of ``master`` (with ``conf`` on top of the tests' own; ``mode``
        tells sessions of one master with different confs apart)."""
        from sparktrain.session import get_or_create_session

        key = f"{master}{mode}"
        if self.master != key:
            self.stop()
            self.session = get_or_create_session(
                master, app_name="sparktrain-tests", conf={**_TEST_CONF, **(conf or {})}
            )
            self.session.sparkContext.parallelize(range(4), 2).count()  # warm-up
            self.master = key
        return self.session

    def stop(self) -> None:
        if self.session is not None:
            self.session.stop()
            self.session = None
            self.master = None


_SESSIONS = _Sessions()


@pytest.fixture(scope="session")
def _sessions() -> Iterator[_Sessions]:
    yield _SESSIONS
    _SESSIONS.stop()


@pytest.fixture()
def spark(_sessions: _Sessions):  # type: ignore[no-untyped-def]
    """A local[2] session, shared by every test that asks for it."""
    return _sessions.get("local[2]")


@pytest.fixture()
def spark_retry(_sessions: _Sessions):  # type: ignore[no-untyped-def]
    """local[2,4]: local mode with up to 4 attempts per task (local[N] never retries)."""
    return _sessions.get("local[2,4]")


@pytest.fixture()
def spark_cluster(_sessions: _Sessions):  # type: ignore[no-untyped-def]
    """Two executor processes with one core each: local-cluster[2,1,1024]."""
    return _sessions.get("local-cluster[2,1,1024]")


@pytest.fixture()
def spark_gpu_cluster(_sessions: _Sessions, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """local-cluster[2,1,1024] whose workers each discover one made-up GPU (as
    pyspark's TorchDistributor tests do): distinct addresses "0" and "1" from a
    discovery script that counts its calls; executors hold one GPU each, and tasks ask
    for none unless their stage's resource profile does."""
    from tests.integration.gpu_discovery import discovery_conf

    return _sessions.get(
        "local-cluster[2,1,1024]",
        conf=discovery_conf(tmp_path_factory.mktemp("gpus")),
        mode="+gpus",
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Unit tests first, then local[2], then local-cluster: each session starts once."""

    def order(item: pytest.Item) -> int:
        fixtures = getattr(item, "fixturenames", ())
        if "spark_gpu_cluster" in fixtures:
            return 4
        if "spark_cluster" in fixtures:
            return 3
        if "spark_retry" in fixtures:
            return 2
        return 1 if "spark" in fixtures else 0

    items.sort(key=order)
