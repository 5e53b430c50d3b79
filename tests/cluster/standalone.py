"""A real Spark standalone cluster, started from pyspark's own ``bin/spark-class``: one
master and N workers, stopped again whatever happens.

    with StandaloneCluster(workdir, workers=2) as cluster:   # on loopback
        spark = SparkSession.builder.master(cluster.url)...

The integration tests (``tests/integration/fixtures.py``) and the multi-host cluster of
:mod:`tests.cluster.netcluster` (workers in network namespaces) share it: the master
listens on ``host``, and each worker may run under a command prefix (``ip netns exec
NS``), on an address of its own, with environment variables of its own.

Every wait is bounded; :meth:`StandaloneCluster.stop` terminates each process tree it
started (a JVM forks executors, which fork Python workers) and nothing else.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """A port free on ``host`` right now (bound and released)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def spark_home() -> Path:
    """pyspark's SPARK_HOME (the wheel ships ``bin/spark-class``)."""
    from pyspark.find_spark_home import _find_spark_home

    return Path(_find_spark_home())


def child_pids(pid: int) -> list[int]:
    """Direct children of a process, from /proc (a JVM forks from any of its threads)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            out += [int(p) for p in (task / "children").read_text().split()]
    return out


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children first level by level)."""
    out, todo = [], [pid]
    while todo:
        for child in child_pids(todo.pop()):
            out.append(child)
            todo.append(child)
    return out


def cmdline(pid: int) -> str:
    """A process's command line ("" once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


class StandaloneCluster:
    """``with StandaloneCluster(workdir, workers=2) as cluster: cluster.url``.

    ``host``: the master's address (its RPC and web UI listen there). ``worker_hosts``:
    one address per worker (default: ``host`` for every one). ``worker_prefix(i)``: a
    command the i-th worker's ``spark-class`` runs under (e.g. ``["ip", "netns", "exec",
    "ns0"]``); ``worker_env(i)``: extra environment for it.
    """

    def __init__(
        self,
        workdir: Path,
        workers: int = 2,
        cores: int = 1,
        memory: str = "1g",
        host: str = LOOPBACK,
        worker_hosts: Sequence[str] | None = None,
        worker_prefix: Callable[[int], list[str]] | None = None,
        worker_env: Callable[[int], dict[str, str]] | None = None,
        start_timeout: float = 90.0,
    ) -> None:
        self.workdir = workdir
        self.workers = workers
        self.cores = cores
        self.memory = memory
        self.host = host
        self.worker_hosts = list(worker_hosts or [host] * workers)
        if len(self.worker_hosts) != workers:
            raise ValueError(f"{workers} workers need {workers} worker_hosts")
        self.worker_prefix = worker_prefix or (lambda i: [])
        self.worker_env = worker_env or (lambda i: {})
        self.start_timeout = start_timeout
        self.port = free_port(host)
        self.ui_port = free_port(host)
        self.url = f"spark://{host}:{self.port}"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.worker_procs: list[subprocess.Popen[bytes]] = []
        self.env = {
            **os.environ,
            "SPARK_LOCAL_IP": host,
            "SPARK_MASTER_HOST": host,
            "PYSPARK_PYTHON": sys.executable,
            "SPARK_WORKER_DIR": str(workdir / "work"),
            "SPARK_LOG_DIR": str(workdir / "logs"),
        }

    def _start(
        self, name: str, *args: str, prefix: Sequence[str] = (), env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        log = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115 - lives with the process
        proc = subprocess.Popen(
            [*prefix, str(spark_home() / "bin" / "spark-class"), *args],
            env={**self.env, **(env or {})},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    def __enter__(self) -> StandaloneCluster:
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            self._start(
                "master",
                "org.apache.spark.deploy.master.Master",
                *("--host", self.host, "--port", str(self.port)),
                *("--webui-port", str(self.ui_port)),
            )
            self.wait_for(lambda s: s.get("status") == "ALIVE", "the master to start")
            self.worker_procs = [self._start_worker(i) for i in range(self.workers)]
            self.wait_for(
                lambda s: s.get("aliveworkers", 0) >= self.workers,
                f"{self.workers} workers to register",
            )
        except BaseException:
            self.stop()
            raise
        return self

    def _start_worker(self, i: int) -> subprocess.Popen[bytes]:
        host = self.worker_hosts[i]
        return self._start(
            f"worker{i}",
            "org.apache.spark.deploy.worker.Worker",
            *("--host", host, "--cores", str(self.cores), "--memory", self.memory),
            # a port picked in the root namespace may be taken in the worker's: the
            # worker's own UI picks its port itself
            *("--webui-port", "0"),
            self.url,
            prefix=self.worker_prefix(i),
            env={"SPARK_LOCAL_IP": host, **self.worker_env(i)},
        )

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def state(self) -> dict[str, Any]:
        """The master's ``/json/`` view (status, workers, applications)."""
        with urllib.request.urlopen(f"http://{self.host}:{self.ui_port}/json/", timeout=5) as r:
            out: dict[str, Any] = json.loads(r.read())
            return out

    def wait_for(
        self, predicate: Callable[[dict[str, Any]], bool], what: str, timeout: float | None = None
    ) -> dict[str, Any]:
        """Poll the master's state until ``predicate`` holds; TimeoutError after
        ``timeout`` seconds (default: ``start_timeout``)."""
        deadline = time.monotonic() + (self.start_timeout if timeout is None else timeout)
        last: object = None
        while time.monotonic() < deadline:
            try:
                state = self.state()
                if predicate(state):
                    return state
            except OSError as exc:
                last = exc
            time.sleep(0.5)
        raise TimeoutError(f"timed out waiting for {what} ({last}); logs in {self.workdir}")

    def executor_pids(self) -> list[int]:
        """JVMs running executors (children of the workers)."""
        return [
            pid
            for w in self.worker_procs
            for pid in descendants(w.pid)
            if "CoarseGrainedExecutorBackend" in cmdline(pid)
        ]

    def stop(self) -> None:
        """SIGTERM every process tree this cluster started, then wait (bounded) and kill."""
        for proc in reversed(self.procs):
            for pid in [*descendants(proc.pid), proc.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        self.procs.clear()
