"""A real Spark standalone cluster on loopback: one master and N workers started from
pyspark's own ``bin/spark-class``, stopped again whatever happens."""

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
from pathlib import Path

LOOPBACK = "127.0.0.1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def spark_home() -> Path:
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
    out, todo = [], [pid]
    while todo:
        for child in child_pids(todo.pop()):
            out.append(child)
            todo.append(child)
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


class StandaloneCluster:
    """``with StandaloneCluster(workers=2, workdir=...) as cluster: cluster.url``."""

    def __init__(self, workdir: Path, workers: int = 2, cores: int = 1, memory: str = "1g") -> None:
        self.workdir = workdir
        self.workers = workers
        self.cores = cores
        self.memory = memory
        self.port = _free_port()
        self.ui_port = _free_port()
        self.url = f"spark://{LOOPBACK}:{self.port}"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.env = {
            **os.environ,
            "SPARK_LOCAL_IP": LOOPBACK,
            "SPARK_MASTER_HOST": LOOPBACK,
            "PYSPARK_PYTHON": sys.executable,
            "SPARK_WORKER_DIR": str(workdir / "work"),
            "SPARK_LOG_DIR": str(workdir / "logs"),
        }

    def _start(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        log = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115 - lives with the process
        proc = subprocess.Popen(
            [str(spark_home() / "bin" / "spark-class"), *args],
            env=self.env,
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
                "--host",
                LOOPBACK,
                "--port",
                str(self.port),
                "--webui-port",
                str(self.ui_port),
            )
            self.wait_for(lambda s: s.get("status") == "ALIVE", "the master to start")
            self.worker_procs = [
                self._start(
                    f"worker{i}",
                    "org.apache.spark.deploy.worker.Worker",
                    "--host",
                    LOOPBACK,
                    "--cores",
                    str(self.cores),
                    "--memory",
                    self.memory,
                    "--webui-port",
                    str(_free_port()),
                    self.url,
                )
                for i in range(self.workers)
            ]
            self.wait_for(
                lambda s: s.get("aliveworkers", 0) >= self.workers,
                f"{self.workers} workers to register",
            )
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def state(self) -> dict:
        with urllib.request.urlopen(f"http://{LOOPBACK}:{self.ui_port}/json/", timeout=5) as r:
            return json.loads(r.read())

    def wait_for(self, predicate, what: str, timeout: float = 90.0) -> dict:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
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
