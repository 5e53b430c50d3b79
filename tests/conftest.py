"""Shared fixtures. Spark starts at most once per master, always on loopback."""

from __future__ import annotations

import os
import sys
import threading
import time
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
            sc = self.session.sparkContext
            sc.parallelize(range(4), 2).count()  # warm-up
            # sparktrain's own warm-up job (driver/warmup.py) runs unawaited: let it end
            # here, where a loaded machine's slow start counts against no test's leftovers
            for _ in range(3000):  # at most ~10 min, as setup.cfg's timeout
                if not sc.statusTracker().getActiveJobsIds():
                    break
                time.sleep(0.2)
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


SPARK_FIXTURES = ("spark", "spark_retry", "spark_cluster", "spark_gpu_cluster")
LEAK_GRACE_S = 15.0  # a cancelled task stops within a few seconds (Python's kill timeout)


@pytest.fixture(autouse=True)
def _no_job_left_running(request: pytest.FixtureRequest) -> Iterator[None]:
    """After every test that used a shared session, nothing of it may still run: a job or
    task left behind holds a slot, and a later 2-task barrier stage on local[2] would
    wait for it forever. The test that leaked fails here, with what it left (and the
    leftovers are cancelled, so the next test starts clean)."""
    yield
    if not _uses_spark(request) or _SESSIONS.session is None:
        return
    leftover = _leftovers(_SESSIONS.session.sparkContext)
    if leftover:
        _SESSIONS.session.sparkContext.cancelAllJobs()
        pytest.fail(f"the test left Spark work running after it returned: {leftover}")


_SET_UP = pytest.StashKey[float]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    item.stash[_SET_UP] = time.monotonic()
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """Shortly before a Spark test's timeout fires, write what Spark still runs to
    stderr: a hang names what it waited for."""
    timer = None
    timeout, func_only = _timeout_of(item)
    if timeout > 0 and any(name in item.fixturenames for name in SPARK_FIXTURES):  # type: ignore[attr-defined]
        spent = 0.0 if func_only else time.monotonic() - item.stash.get(_SET_UP, time.monotonic())
        timer = threading.Timer(max(1.0, timeout - spent - 5.0), _say_what_runs, (item.nodeid,))
        timer.daemon = True
        timer.start()
    try:
        return (yield)
    finally:
        if timer is not None:
            timer.cancel()


def _uses_spark(request: pytest.FixtureRequest) -> bool:
    return any(name in request.fixturenames for name in SPARK_FIXTURES)


def _timeout_of(item: pytest.Item) -> tuple[float, bool]:
    """The test's pytest-timeout (its marker, else ``--timeout``/setup.cfg's) and whether
    it counts the test function only."""
    func_only = bool(item.config.getini("timeout_func_only"))
    marker = item.get_closest_marker("timeout")
    if marker is not None and (marker.args or "timeout" in marker.kwargs):
        func_only = bool(marker.kwargs.get("func_only", func_only))
        return float(marker.args[0] if marker.args else marker.kwargs["timeout"]), func_only
    option = item.config.getoption("timeout", None)
    return float(option if option is not None else item.config.getini("timeout") or 0), func_only


def _say_what_runs(nodeid: str) -> None:
    """Written past pytest's capture (the thread method of pytest-timeout exits the
    process): the jobs and tasks Spark runs as the test is about to time out."""
    from sparktrain.driver.occupancy import active_jobs, describe, running_tasks

    try:
        sc = _SESSIONS.session.sparkContext  # type: ignore[union-attr]
        state = describe(active_jobs(sc), running_tasks(sc))
    except Exception as exc:
        state = f"(could not ask Spark: {exc})"
    print(f"\n{nodeid} is about to time out; Spark runs: {state}", file=sys.__stderr__)


def _leftovers(sc) -> str:  # type: ignore[no-untyped-def]
    """What of ``sc`` still runs after :data:`LEAK_GRACE_S` ('' when nothing does)."""
    from sparktrain.driver.occupancy import active_jobs, describe, running_tasks

    deadline = time.monotonic() + LEAK_GRACE_S
    while True:
        try:
            jobs, running = active_jobs(sc), running_tasks(sc)
        except Exception:  # the session died with the test (a timeout): nothing runs
            return ""
        if not jobs and running == 0:
            return ""
        if time.monotonic() >= deadline:
            return describe(jobs, running)
        time.sleep(0.2)


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
