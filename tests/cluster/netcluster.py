"""A small multi-host Spark cluster on one machine: one network namespace per worker,
joined by veth pairs to a bridge in the root namespace, links shaped by the kernel.

    with NetCluster(workdir, workers=2, rate_mbit=100) as net:
        spark = net.session()            # the driver in the root namespace
        ...
        net.shape(None)                  # unshaped from here on
        net.counters()                   # bytes each worker's veth carried

Layout (``SUBNET`` = 10.213.7.0/24; every name starts with ``PREFIX``, so leftovers of a
killed earlier run are found and removed by name)::

    root namespace: bridge sthbr0 10.213.7.1 -- Spark master, the driver, its services
        sthv0 (tbf) ─ veth ─ eth0 (tbf) in namespace sth-w0, 10.213.7.10 -- Spark worker 0
        sthv1 (tbf) ─ veth ─ eth0 (tbf) in namespace sth-w1, 10.213.7.11 -- Spark worker 1

A worker's Spark JVM runs under ``ip netns exec``, bound to its own address; the executor
it forks and the Python workers of its tasks inherit the namespace, so whatever two tasks
send each other (sparktrain's ring, Gloo's) crosses both veths and the bridge. Shaping is
``tc tbf`` (this kernel has no netem: no kernel-made delay) on the egress of both ends of
each veth, so a worker's uplink and downlink each carry at most ``rate_mbit``; traffic
between two workers passes two shapers of the same rate, which together still carry at
most that rate. Inside every namespace the interface is called ``eth0``, so one
``GLOO_SOCKET_IFNAME`` serves every executor.

Needs root and ``ip``/``tc`` (:func:`unavailable` says why not). Every command and wait is
bounded in time; :meth:`NetCluster.close` removes everything it made even after a
failure, and :func:`remove_leftovers` what a killed run left.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.cluster.standalone import StandaloneCluster

PREFIX = "sth"
"""Every namespace and link this module makes starts with it (sparktrain host)."""
BRIDGE = f"{PREFIX}br0"
SUBNET = "10.213.7"
DRIVER_IP = f"{SUBNET}.1"
WORKER_IFNAME = "eth0"
"""A worker's interface name inside its namespace (the same in every namespace)."""
MAX_WORKERS = 8
ROOT = Path(__file__).resolve().parents[2]
"""The repository's root: the executors import ``benchmarks`` and ``tests`` from it."""
TBF_BURST = "64kb"  # as tests/unit/test_link.py's kernel reference and link.py's bucket
TBF_LATENCY = "400ms"  # queue bound; a deep queue so TCP is not dropped into slow start
CMD_TIMEOUT_S = 20.0


def executor_pythonpath() -> str:
    """The executors' ``PYTHONPATH``: the repository's root (the benchmarks' code they run
    is not installed), then the driver's own."""
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join(dict.fromkeys([str(ROOT), *path]))


def _tool(name: str) -> str | None:
    return shutil.which(name) or next(
        (p for p in (f"/usr/sbin/{name}", f"/sbin/{name}") if os.access(p, os.X_OK)), None
    )


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None when they can): not root, no ``ip`` or
    ``tc``, or the kernel refuses a namespace."""
    if os.geteuid() != 0:
        return "network namespaces need root (run as root, e.g. in the CI container)"
    for tool in ("ip", "tc"):
        if _tool(tool) is None:
            return f"`{tool}` not found (install iproute2)"
    name = f"{PREFIX}-probe{os.getpid()}"
    try:
        _run("ip", "netns", "add", name)
    except RuntimeError as exc:
        return f"cannot create a network namespace: {exc}"
    finally:
        _run("ip", "netns", "del", name, check=False)
    return None


def _run(*cmd: str, check: bool = True, netns: str | None = None) -> str:
    """Run a command (in ``netns`` if given), bounded in time; RuntimeError with its
    output when it fails and ``check``."""
    argv = [_tool(cmd[0]) or cmd[0], *cmd[1:]]
    if netns is not None:
        argv = [_tool("ip") or "ip", "netns", "exec", netns, *argv]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=CMD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        if check:
            raise RuntimeError(f"{' '.join(argv)}: {exc}") from exc
        return ""
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {(proc.stderr or proc.stdout).strip()}")
    return proc.stdout


def namespace(i: int) -> str:
    return f"{PREFIX}-w{i}"


def root_link(i: int) -> str:
    return f"{PREFIX}v{i}"


def worker_ip(i: int) -> str:
    return f"{SUBNET}.{10 + i}"


def remove_leftovers() -> list[str]:
    """Delete every namespace and link whose name starts with ``PREFIX`` (what a killed
    run left; deleting a namespace deletes its end of a veth, which deletes the other).
    Processes still running in a namespace are killed first. Returns what was removed."""
    removed = []
    for line in _run("ip", "netns", "list", check=False).splitlines():
        name = line.split()[0] if line.split() else ""
        if name.startswith(f"{PREFIX}-"):
            for pid in _run("ip", "netns", "pids", name, check=False).split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), 9)
            _run("ip", "netns", "del", name, check=False)
            removed.append(name)
    for line in _run("ip", "-o", "link", "show", check=False).splitlines():
        parts = line.split(":")
        name = parts[1].strip().split("@")[0] if len(parts) > 1 else ""
        if name.startswith(PREFIX):
            _run("ip", "link", "del", name, check=False)
            removed.append(name)
    return removed


@dataclass(frozen=True)
class LinkBytes:
    """Bytes a worker's veth carried (root side counters: rx = sent by the worker)."""

    sent: int
    received: int


class NetCluster:
    """Namespaces, veths, a bridge, ``tbf`` shaping and a standalone Spark cluster with
    one worker per namespace (see the module docstring). A context manager; ``close``
    removes everything and is safe to call twice."""

    def __init__(
        self,
        workdir: Path,
        workers: int = 2,
        rate_mbit: float | None = None,
        cores: int = 1,
        memory: str = "1g",
    ) -> None:
        if not 1 <= workers <= MAX_WORKERS:
            raise ValueError(f"workers={workers}: use 1..{MAX_WORKERS}")
        self.workdir = workdir
        self.workers = workers
        self.rate_mbit: float | None = None
        self._initial_rate = rate_mbit
        self.cores = cores
        self.memory = memory
        self.spark: StandaloneCluster | None = None

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> NetCluster:
        reason = unavailable()
        if reason is not None:
            raise RuntimeError(f"cannot build the multi-host cluster: {reason}")
        remove_leftovers()
        try:
            self._build_network()
            self.shape(self._initial_rate)
            self.spark = StandaloneCluster(
                self.workdir,
                workers=self.workers,
                cores=self.cores,
                memory=self.memory,
                host=DRIVER_IP,
                worker_hosts=[worker_ip(i) for i in range(self.workers)],
                worker_prefix=lambda i: [_tool("ip") or "ip", "netns", "exec", namespace(i)],
                worker_env=lambda i: {"GLOO_SOCKET_IFNAME": WORKER_IFNAME},
            ).__enter__()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop Spark, then delete the namespaces, veths and bridge."""
        try:
            if self.spark is not None:
                self.spark.stop()
                self.spark = None
        finally:
            remove_leftovers()

    def _build_network(self) -> None:
        _run("ip", "link", "add", BRIDGE, "type", "bridge")
        _run("ip", "addr", "add", f"{DRIVER_IP}/24", "dev", BRIDGE)
        _run("ip", "link", "set", BRIDGE, "up")
        for i in range(self.workers):
            ns, veth, peer = namespace(i), root_link(i), f"{PREFIX}p{i}"
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", veth, "type", "veth", "peer", "name", peer)
            _run("ip", "link", "set", peer, "netns", ns)
            _run("ip", "link", "set", peer, "name", WORKER_IFNAME, netns=ns)
            _run("ip", "addr", "add", f"{worker_ip(i)}/24", "dev", WORKER_IFNAME, netns=ns)
            _run("ip", "link", "set", WORKER_IFNAME, "up", netns=ns)
            # Spark's Python workers talk to their executor over loopback
            _run("ip", "link", "set", "lo", "up", netns=ns)
            _run("ip", "link", "set", veth, "master", BRIDGE)
            _run("ip", "link", "set", veth, "up")

    # ------------------------------------------------------------------ shaping
    def shape(self, rate_mbit: float | None) -> None:
        """Put a ``tbf`` of ``rate_mbit`` on both ends of every worker's veth (None or 0:
        remove it, the links run at veth speed)."""
        for i in range(self.workers):
            for dev, ns in ((root_link(i), None), (WORKER_IFNAME, namespace(i))):
                _run("tc", "qdisc", "del", "dev", dev, "root", check=False, netns=ns)
                if rate_mbit:
                    _run(
                        *("tc", "qdisc", "add", "dev", dev, "root", "tbf"),
                        *("rate", f"{rate_mbit:g}mbit", "burst", TBF_BURST),
                        *("latency", TBF_LATENCY),
                        netns=ns,
                    )
        self.rate_mbit = rate_mbit or None

    def qdiscs(self) -> dict[str, str]:
        """``tc qdisc show`` of each worker's two ends (what shapes them now)."""
        out = {}
        for i in range(self.workers):
            out[root_link(i)] = _run("tc", "qdisc", "show", "dev", root_link(i)).strip()
            out[f"{namespace(i)}:{WORKER_IFNAME}"] = _run(
                "tc", "qdisc", "show", "dev", WORKER_IFNAME, netns=namespace(i)
            ).strip()
        return out

    # ------------------------------------------------------------------ counters
    def counters(self) -> list[LinkBytes]:
        """Per worker, the bytes its veth carried so far (Ethernet frames, headers
        included), read from the root side's /sys/class/net statistics."""
        out = []
        for i in range(self.workers):
            stats = Path("/sys/class/net") / root_link(i) / "statistics"
            out.append(
                LinkBytes(
                    sent=int((stats / "rx_bytes").read_text()),
                    received=int((stats / "tx_bytes").read_text()),
                )
            )
        return out

    # ------------------------------------------------------------------ Spark
    @property
    def url(self) -> str:
        if self.spark is None:
            raise RuntimeError("the cluster is not running (use it as a context manager)")
        return self.spark.url

    def spark_conf(self, cores_max: int | None = None) -> dict[str, str]:
        """The driver's conf for this cluster: the driver (and sparktrain's driver
        services, which listen on ``spark.driver.host``) on the bridge's address, one
        one-core executor per worker."""
        return {
            "spark.master": self.url,
            "spark.driver.host": DRIVER_IP,
            "spark.driver.bindAddress": DRIVER_IP,
            "spark.ui.enabled": "false",
            "spark.executor.cores": str(self.cores),
            "spark.cores.max": str(cores_max or self.workers * self.cores),
            "spark.executor.memory": "768m",
            "spark.executorEnv.GLOO_SOCKET_IFNAME": WORKER_IFNAME,
            "spark.executorEnv.PYTHONPATH": executor_pythonpath(),
            "spark.pyspark.python": sys.executable,
            "spark.barrier.sync.timeout": "120s",
            "spark.task.maxFailures": "1",
        }

    def wait_for_executors(
        self, spark: Any, count: int | None = None, timeout: float = 90.0
    ) -> None:
        """Block (bounded) until ``count`` executors (default: one per worker) have
        registered with the driver."""
        import time

        want = self.workers if count is None else count
        sc = spark.sparkContext
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            # the driver itself is one of the block managers
            if sc._jsc.sc().getExecutorMemoryStatus().size() >= want + 1:
                return
            time.sleep(0.5)
        raise TimeoutError(f"{want} executors did not register; logs in {self.workdir}")
