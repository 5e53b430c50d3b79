"""The helpers the Spark Connect tests share: pyspark's own Connect server on loopback
(:class:`ConnectServer`, started from the wheel's ``sbin/start-connect-server.sh`` and
stopped again whatever happens), a client session for it, and the digits helpers of the
integration tests (re-exported, so test files here import from their tree's fixtures).

Why the client flips ``SPARK_CONNECT_MODE_ENABLED`` itself: pyspark decides between its
classic and its Connect implementation of ``functions``, ``pyspark.ml`` and friends with
that process-wide variable (``pyspark.sql.utils.is_remote``). Connect tests set it while
they run and restore it afterwards, so classic-session tests in the same pytest process
(a marked run mixes them) still get the classic implementations.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.integration.fixtures import (  # noqa: F401 - re-exported for the connect tests
    DIGITS_MODEL,
    PIXELS,
    SUMMARY_KEYS,
    accuracy,
    descendants,
    digits,
    digits_frames,
    digits_pipeline_of,
    fast_config,
    pixel_frames,
    rank_1_gives_up,
    spark_home,
)

LOOPBACK = "127.0.0.1"
REPO = Path(__file__).resolve().parents[2]
CONNECT_MODE = "SPARK_CONNECT_MODE_ENABLED"

# The server is the Spark driver: sparktrain's own session defaults (loopback, the
# torch-preloading Python daemon, Arrow), plus the integration tests' fast-failing ones.
SERVER_CONF: dict[str, str] = {
    "spark.driver.host": LOOPBACK,
    "spark.driver.bindAddress": LOOPBACK,
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.barrier.sync.timeout": "120s",
    "spark.task.maxFailures": "1",
    "spark.sql.shuffle.partitions": "2",
    "spark.default.parallelism": "2",
    "spark.sql.execution.arrow.pyspark.enabled": "true",
    "spark.python.worker.reuse": "true",
    "spark.python.daemon.module": "sparktrain.driver.daemon",
}


def java_missing() -> str | None:
    """Why a Connect server cannot start here, or None when Java is available."""
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").exists():
        return None
    if shutil.which("java"):
        return None
    return "the Spark Connect server needs Java: no `java` on PATH and no JAVA_HOME"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


class ConnectServer:
    """``with ConnectServer(workdir) as server: server.url`` — pyspark's Connect server
    in the foreground (``--wait``) in a process group of its own, so stopping it kills
    the JVM and every Python worker it forked, whatever state the tests left it in."""

    def __init__(
        self,
        workdir: Path,
        master: str = "local[2]",
        conf: dict[str, str] | None = None,
        start_timeout_s: float = 120.0,
    ) -> None:
        self.workdir = workdir
        self.master = master
        self.conf = {**SERVER_CONF, **(conf or {})}
        self.start_timeout_s = start_timeout_s
        self.port = free_port()
        self.url = f"sc://{LOOPBACK}:{self.port}"
        self.log = workdir / "connect-server.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        cmd = [str(spark_home() / "sbin" / "start-connect-server.sh"), "--wait"]
        cmd += ["--master", self.master]
        conf = {
            **self.conf,
            "spark.connect.grpc.binding.address": LOOPBACK,
            "spark.connect.grpc.binding.port": str(self.port),
        }
        for key, value in conf.items():
            cmd += ["--conf", f"{key}={value}"]
        return cmd

    def env(self) -> dict[str, str]:
        # The server's Python workers import sparktrain from this checkout (first on the
        # path), as the driver's tests do.
        path = [str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        return {
            **os.environ,
            "SPARK_LOCAL_IP": LOOPBACK,
            "PYSPARK_PYTHON": sys.executable,
            "PYSPARK_DRIVER_PYTHON": sys.executable,
            "PYTHONPATH": os.pathsep.join(dict.fromkeys(path)),
            # the daemon script's log and pid files: here, not in the wheel or /tmp
            "SPARK_LOG_DIR": str(self.workdir / "logs"),
            "SPARK_PID_DIR": str(self.workdir / "pids"),
            "SPARK_IDENT_STRING": f"sparktrain-tests-{self.port}",
        }

    def __enter__(self) -> ConnectServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in self.env().items() if k != CONNECT_MODE}
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                self.command(),
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        try:
            self.wait_until_listening()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_until_listening(self) -> None:
        """Until the gRPC port accepts connections; bounded, and fails at once (with the
        log's tail) when the server exits."""
        assert self.proc is not None
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"the Spark Connect server exited with {self.proc.returncode}:\n{self.tail()}"
                )
            try:
                with socket.create_connection((LOOPBACK, self.port), timeout=1.0):
                    return
            except OSError:
                time.sleep(0.5)
        raise TimeoutError(
            f"the Spark Connect server did not listen on {self.url} within "
            f"{self.start_timeout_s:.0f} s:\n{self.tail()}"
        )

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """TERM the whole process group (and any descendant that left it), wait bounded,
        then KILL what is left."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        pids = [*descendants(proc.pid), proc.pid]
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):  # then KILL what is left
            proc.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)


@contextlib.contextmanager
def connect_mode() -> Iterator[None]:
    """pyspark's process-wide Connect switch on for the block, as it was afterwards."""
    before = os.environ.get(CONNECT_MODE)
    os.environ[CONNECT_MODE] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(CONNECT_MODE, None)
        else:
            os.environ[CONNECT_MODE] = before


@contextlib.contextmanager
def classic_mode() -> Iterator[None]:
    """pyspark's Connect switch off for the block (a classic session's work inside a
    connect test), as it was afterwards."""
    before = os.environ.pop(CONNECT_MODE, None)
    try:
        yield
    finally:
        if before is not None:
            os.environ[CONNECT_MODE] = before


def client_session(url: str) -> Any:
    """A Spark Connect client session for ``url``: what
    ``SparkSession.builder.remote(url).getOrCreate()`` builds, asked of pyspark's Connect
    builder directly, since the classic builder refuses while a classic session lives in
    this process (a marked run has both)."""
    from pyspark.sql.connect.session import SparkSession as RemoteSparkSession

    with connect_mode():
        return RemoteSparkSession.builder.remote(url).create()
