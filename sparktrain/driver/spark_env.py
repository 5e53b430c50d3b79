"""What the driver side needs from Spark, for a classic session and a Spark Connect one.

A classic session has a ``SparkContext`` (its conf, slot counts through the JVM, job
groups, broadcasts); a Spark Connect session has none of that: only ``spark.conf``, the
DataFrame API and operation tags. :class:`SparkEnv` is the one interface the launch
path uses (confs, the master, task CPUs, free task slots, the address of the driver's
services, a cancellable job group), with :class:`ClassicEnv` and :class:`ConnectEnv`
behind it. :func:`spark_env` picks one for a session; :func:`is_connect` tells a Connect
session (or DataFrame) from a classic one by its class, not by pyspark's process-wide
``is_remote()``, which says only that *some* Connect session exists in this process.

Under Connect, sparktrain's driver services (metrics channel, rendezvous, state
receiver, PS shards) run in the client process, which is not the Spark driver: they
listen on the address this client has towards the Connect server (see
:meth:`ConnectEnv.driver_host`).
"""

from __future__ import annotations

import abc
import contextlib
import ipaddress
import logging
import os
import re
import socket
import threading
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from sparktrain.errors import ConfigError, DataError

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark import SparkContext

log = logging.getLogger(__name__)

_LOCAL = re.compile(r"^local(\[(\*|\d+)(,\s*\d+)?\])?$")
_LOCAL_CLUSTER = re.compile(r"^local-cluster\[\s*(\d+)\s*,\s*(\d+)\s*,\s*\d+\s*\]$")
_CONNECT_PREFIX = "pyspark.sql.connect."

# What SparkContext.setJobGroup sets in the calling thread (restored after a stage).
_JOB_GROUP_PROPERTIES = (
    "spark.jobGroup.id",
    "spark.job.description",
    "spark.job.interruptOnCancel",
)


def is_connect(obj: object) -> bool:
    """Is ``obj`` (a SparkSession or DataFrame) a Spark Connect one?"""
    return type(obj).__module__.startswith(_CONNECT_PREFIX)


def is_local_master(master: str) -> bool:
    """``local``/``local[N]``/``local[N,F]``/``local[*]``: slots never change while the
    application runs, and every task runs on the driver's host."""
    return bool(_LOCAL.match(master.strip()))


def slots_from_conf(
    master: str, conf: dict[str, str | None], host_cpus: int | None = None
) -> int | None:
    """Task slots a master offers, from its name and the application's conf alone (what
    a Spark Connect client can see): ``local[N]`` gives N cores, ``local[*]`` the
    server's ``host_cpus``, ``local-cluster[n,c,m]`` n·c, other masters
    ``spark.executor.instances`` · ``spark.executor.cores`` when both are set (static
    allocation); each divided by ``spark.task.cpus``. ``None``: cannot be told."""
    cpus_per_task = max(1, int(conf.get("spark.task.cpus") or 1))
    master = master.strip()
    cores: int | None = None
    local = _LOCAL.match(master)
    cluster = _LOCAL_CLUSTER.match(master)
    if local:
        threads = local.group(2)
        cores = 1 if threads is None else host_cpus if threads == "*" else int(threads)
    elif cluster:
        cores = int(cluster.group(1)) * int(cluster.group(2))
    else:
        instances, per_executor = (
            conf.get("spark.executor.instances"),
            conf.get("spark.executor.cores"),
        )
        if instances and per_executor:
            cores = int(instances) * int(per_executor)
    return None if cores is None else cores // cpus_per_task


# Spark Connect's cap on one request (spark.connect.grpc.maxInboundMessageSize), default.
CONNECT_MAX_MESSAGE = 128 << 20
_BYTES = re.compile(r"^\s*(\d+)\s*([kmgtp]?)(i?b)?\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """A Spark byte-size setting (``134217728``, ``128m``, ``128mb``, ``1g``) in bytes;
    units are powers of 1024, as in Spark."""
    match = _BYTES.match(text)
    if not match:
        raise ValueError(f"not a byte size: {text!r}")
    power = " kmgtp".index((match.group(2) or " ").lower())
    return int(match.group(1)) << (10 * power)


def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback address (IPv4 or IPv6, bracketed or not)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def address_towards(host: str, port: int) -> str | None:
    """This machine's address on the route to ``host`` (a UDP socket's local end: no
    packet is sent), or None when there is no route."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family[0], socket.SOCK_DGRAM) as probe:
            probe.connect(family[4])
            return str(probe.getsockname()[0])
    except OSError:
        return None


class SparkEnv(abc.ABC):
    """The driver side's view of Spark (see the module docstring)."""

    connect: bool = False

    @property
    @abc.abstractmethod
    def master(self) -> str:
        """The application's master URL (``local[2]``, ``spark://...``)."""

    @abc.abstractmethod
    def conf(self, key: str, default: str | None = None) -> str | None:
        """The application's setting ``key``, else ``default``."""

    @abc.abstractmethod
    def slots(self, profile_id: int = 0) -> int | None:
        """Task slots Spark can run at once (what barrier scheduling needs) for the
        resource profile ``profile_id`` (0: the default); None when this session cannot
        count them."""

    @abc.abstractmethod
    def driver_host(self) -> str:
        """The address sparktrain's driver services listen on (the executors dial it)."""

    @abc.abstractmethod
    def job_group(self, group: str, description: str) -> contextlib.AbstractContextManager[None]:
        """Jobs submitted by this thread inside the block belong to ``group`` (cancellable
        as one); the thread's previous settings come back afterwards."""

    @abc.abstractmethod
    def cancel_group(self, group: str) -> None:
        """Cancel every running job of ``group`` (see :meth:`job_group`)."""

    @property
    def watches_slots(self) -> bool:
        """Can :meth:`slots` see executors come and go while a stage waits?"""
        return False

    def task_cpus(self) -> int:
        return int(self.conf("spark.task.cpus") or 1)

    def max_request_bytes(self) -> int | None:
        """The cap on one request to Spark (a plan with its closures); None: no cap."""
        return None

    def is_local(self) -> bool:
        return is_local_master(self.master)

    def spark_context(self, what: str) -> SparkContext:
        """The classic SparkContext, for ``what`` needs it (RDDs, broadcasts)."""
        raise ConfigError(f"{what} needs the classic PySpark API (a SparkContext)")


class ClassicEnv(SparkEnv):
    """A classic session: everything through its SparkContext."""

    def __init__(self, sc: SparkContext) -> None:
        self.sc = sc

    @property
    def master(self) -> str:
        return str(self.sc.master)

    def conf(self, key: str, default: str | None = None) -> str | None:
        value = self.sc.getConf().get(key, default)
        return None if value is None else str(value)

    def slots(self, profile_id: int = 0) -> int | None:
        jsc = self.sc._jsc.sc()
        profile = jsc.resourceProfileManager().resourceProfileFromId(profile_id)
        return int(jsc.maxNumConcurrentTasks(profile))

    @property
    def watches_slots(self) -> bool:
        return True

    def driver_host(self) -> str:
        return self.conf("spark.driver.host") or "127.0.0.1"

    @contextlib.contextmanager
    def job_group(self, group: str, description: str) -> Iterator[None]:
        sc = self.sc
        saved = {k: sc.getLocalProperty(k) for k in _JOB_GROUP_PROPERTIES}
        sc.setJobGroup(group, description, True)
        try:
            with _quiet_console(sc, group):
                yield
        finally:
            for key, value in saved.items():
                sc.setLocalProperty(key, value)  # type: ignore[arg-type]

    def cancel_group(self, group: str) -> None:
        self.sc.cancelJobGroup(group)

    def spark_context(self, what: str) -> SparkContext:
        return self.sc


def _quiet_console(sc: SparkContext, group: str) -> contextlib.AbstractContextManager[None]:
    """A sparktrain stage's console: no stack traces for the task failures it handles,
    no Spark progress bar over its own (:mod:`sparktrain.driver.console`)."""
    from sparktrain.driver.console import quiet_stage

    return quiet_stage(sc, group)


class ConnectEnv(SparkEnv):
    """A Spark Connect session: confs through ``spark.conf``, slots from the master and
    the conf (:func:`slots_from_conf`), job groups as operation tags."""

    connect = True

    def __init__(self, session: Any) -> None:
        self.session = session
        self._slots: int | None = None
        self._counted = False

    @property
    def master(self) -> str:
        return self.conf("spark.master") or ""

    def conf(self, key: str, default: str | None = None) -> str | None:
        value = self.session.conf.get(key, default)
        return None if value is None else str(value)

    def slots(self, profile_id: int = 0) -> int | None:
        if profile_id:  # the conf says nothing about a task-level profile's GPUs
            return None
        if self._counted:  # a Connect client sees only configured slots: they do not change
            return self._slots
        keys = ("spark.task.cpus", "spark.executor.instances", "spark.executor.cores")
        conf = {k: self.conf(k) for k in keys}
        master = self.master
        local = _LOCAL.match(master.strip())
        every_core = local is not None and local.group(2) == "*"
        host_cpus = server_cpus(self.session) if every_core else None
        self._slots, self._counted = slots_from_conf(master, conf, host_cpus), True
        return self._slots

    def driver_host(self) -> str:
        """On the Connect server's host (a loopback URL), the Spark driver's own address;
        otherwise this client's address on the route to the server, which executors of
        the same network reach (a client behind NAT needs a later option)."""
        server = self.server_host()
        if server is None or is_loopback(server):
            return self.conf("spark.driver.host") or "127.0.0.1"
        # any port: connecting a UDP socket only picks the route, it sends nothing
        return address_towards(server, 15002) or self.conf("spark.driver.host") or "127.0.0.1"

    def server_host(self) -> str | None:
        """The host of the Connect URL (pyspark keeps it on the client's channel builder;
        None if a later pyspark moves it)."""
        builder = getattr(getattr(self.session, "client", None), "_builder", None)
        host = getattr(builder, "host", None)
        return str(host) if host else None

    @contextlib.contextmanager
    def job_group(self, group: str, description: str) -> Iterator[None]:
        # Tags are per thread, as job groups are; Connect has no job description.
        self.session.addTag(group)
        try:
            yield
        finally:
            self.session.removeTag(group)

    def cancel_group(self, group: str) -> None:
        self.session.interruptTag(group)

    def max_request_bytes(self) -> int:
        """The server's cap on one request (``spark.connect.grpc.maxInboundMessageSize``):
        what weights shipped in a closure must stay well under."""
        value = self.conf("spark.connect.grpc.maxInboundMessageSize")
        try:
            return parse_bytes(value) if value else CONNECT_MAX_MESSAGE
        except ValueError:
            return CONNECT_MAX_MESSAGE

    def spark_context(self, what: str) -> SparkContext:
        raise ConfigError(
            f"{what} needs the classic PySpark API (RDDs, broadcasts), which a Spark Connect "
            "session does not offer; under Spark Connect use a barrier strategy ('ring', "
            "'tree' or 'ps'), or a classic session"
        )


UNIX_SOCKETS = "spark.python.unix.domain.socket.enabled"
"""Spark's setting (4.1+) that puts PySpark's driver-side accumulator server, and the
JVM's sockets to Python processes, on Unix domain sockets instead of loopback TCP ports."""

_tcp_warned = False
_tcp_warned_lock = threading.Lock()


def tcp_accumulator_address(sc: Any) -> tuple[str, int] | None:
    """Where PySpark's accumulator server of ``sc`` listens, when it is a TCP listener
    (None: a Unix domain socket, or no server). Its address tells: a Unix socket's is
    a path."""
    address = getattr(getattr(sc, "_accumulatorServer", None), "server_address", None)
    if isinstance(address, tuple) and len(address) >= 2:
        return str(address[0]), int(address[1])
    return None


def warn_tcp_accumulator(sc: Any) -> bool:
    """Warn, once per process, when ``sc``'s accumulator server is a TCP listener;
    returns whether it warned now.

    PySpark's ``AccumulatorTCPServer`` serves one connection at a time, and Spark's
    DAGScheduler opens its connection lazily, at the first Python task's end: a local
    process that connects first and sends nothing holds the server, and the scheduler
    waits on it forever, so every job of the driver hangs. :data:`UNIX_SOCKETS` moves it
    to a Unix socket that only the user can open. Sessions that
    :func:`sparktrain.session.get_or_create_session` builds set it; a user's own might not.
    """
    global _tcp_warned
    address = tcp_accumulator_address(sc)
    if address is None:
        return False
    with _tcp_warned_lock:
        if _tcp_warned:
            return False
        _tcp_warned = True
    log.warning(
        "PySpark's accumulator server of this session listens on TCP %s:%d and serves one "
        "connection at a time: any local process that connects to it before Spark does and "
        "stays silent stalls every Python job of this driver. Start the session with "
        '%s=true (Spark >= 4.1): SparkSession.builder.config("%s", "true"), '
        "--conf %s=true for spark-submit, or sparktrain.session.get_or_create_session(), "
        "which sets it (docs/security.md)",
        address[0],
        address[1],
        UNIX_SOCKETS,
        UNIX_SOCKETS,
        UNIX_SOCKETS,
    )
    return True


def spark_env(session: Any) -> SparkEnv:
    """The :class:`SparkEnv` of a classic or Spark Connect session (for a classic one,
    after :func:`warn_tcp_accumulator`: every fit asks for its env)."""
    if is_connect(session):
        return ConnectEnv(session)
    sc = session.sparkContext
    warn_tcp_accumulator(sc)
    return ClassicEnv(sc)


def session_of(data: Any) -> Any:
    """The session a DataFrame belongs to (None for anything else): a fit runs where
    its data lives."""
    from pyspark.sql import DataFrame

    return data.sparkSession if isinstance(data, DataFrame) else None


def check_data_kind(env: SparkEnv, *data: Any) -> None:
    """Under Spark Connect the data must be DataFrames: RDDs need a SparkContext."""
    if not env.connect:
        return
    from pyspark import RDD

    if any(isinstance(d, RDD) for d in data):
        raise DataError(
            "this is a Spark Connect session, which has no RDDs: pass a DataFrame instead "
            "(e.g. spark.createDataFrame(rows, ['features', 'label']) with the features as "
            "an array or ml Vector column)"
        )


def _cpu_count(batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    import pyarrow as pa

    for _ in batches:
        pass
    yield pa.RecordBatch.from_pylist(
        [{"cpus": os.cpu_count() or 1}], schema=pa.schema([("cpus", pa.int64())])
    )


def server_cpus(session: Any) -> int | None:
    """The CPUs of the host a ``local[*]`` Connect server runs its tasks on: one tiny job
    (the client cannot see the server's cores any other way)."""
    try:
        row = session.range(1, numPartitions=1).mapInArrow(_cpu_count, "cpus long").first()
        return int(row["cpus"])
    except Exception as exc:  # only a check: the stage will tell
        log.info("could not count the Connect server's cores (%s)", exc)
        return None
