"""The victim of tests/integration/test_accumulator_attack.py, in a process of its own.

``python -m tests.integration.accumulator_victim MASTER`` starts a session the way
sparktrain does (:func:`sparktrain.session.get_or_create_session`, no warm-up job), and
before any Spark job runs opens :data:`SILENT` connections that never send a byte, from
127.0.0.2, to every TCP listener of the driver: its Python process (PySpark's
accumulator server, when it is a TCP one) and its JVM. Then a small digits fit, a
``toArrow()`` and an RDD job that adds to an accumulator; it prints one JSON line with
what it attacked and what came back.

A process of its own because a stalled driver cannot be recovered: PySpark's TCP
accumulator server serves one connection at a time, and when a stranger's comes before
the JVM's (which Spark opens at the first Python task's end), Spark's DAGScheduler
waits on the server forever. The test bounds this process with a timeout and kills it.
"""

from __future__ import annotations

import json
import os
import socket
import sys

from sparktrain import Trainer
from sparktrain.driver.spark_env import UNIX_SOCKETS, tcp_accumulator_address
from sparktrain.session import get_or_create_session
from tests.integration.fixtures import DIGITS_MODEL, child_pids, cmdline, digits_frames, fast_config
from tests.proc_net import listeners

SILENT = 20  # per listener, as measured in the issue
SOURCE = "127.0.0.2"
CONNECT_S = 1.0  # a connect the backlog no longer takes is given up after this


def flood(address: tuple[str, int], held: list[socket.socket]) -> int:
    """Open up to :data:`SILENT` silent connections to ``address``; returns how many."""
    host, port = address
    host = host.removeprefix("::ffff:")  # an IPv4-mapped address: dial it over IPv4
    if host in ("0.0.0.0", "::"):
        host = "127.0.0.1"
    opened = 0
    for _ in range(SILENT):
        v6 = ":" in host
        sock = socket.socket(socket.AF_INET6 if v6 else socket.AF_INET)
        sock.settimeout(CONNECT_S)
        try:
            if not v6:
                sock.bind((SOURCE, 0))  # another loopback address: another "host"
            sock.connect((host, port))
        except OSError:  # the backlog is full: the listener takes no more for now
            sock.close()
            break
        held.append(sock)
        opened += 1
    return opened


def driver_listeners() -> dict[str, list[tuple[str, int]]]:
    """The TCP listeners of this process and of the driver JVM it started."""
    found = {"python": listeners()}
    for pid in child_pids(os.getpid()):
        if "java" in cmdline(pid):
            found[f"jvm {pid}"] = listeners(pid)
    return found


def main(master: str) -> None:
    spark = get_or_create_session(
        master,
        app_name="sparktrain-accumulator-attack",
        conf={"spark.task.maxFailures": "1", "spark.sql.shuffle.partitions": "2"},
        warm_workers=False,  # the attack comes before the first job, as a stranger's can
    )
    sc = spark.sparkContext
    accumulator_tcp = tcp_accumulator_address(sc)
    held: list[socket.socket] = []
    attacked = {
        f"{who} {host}:{port}": flood((host, port), held)
        for who, found in driver_listeners().items()
        for host, port in found
    }
    train, test = digits_frames(spark)
    result = Trainer(DIGITS_MODEL, fast_config(epochs=3), spark=spark).fit(
        train, validation_data=test
    )
    rows = spark.range(100).toArrow().num_rows
    total = sc.accumulator(0)
    sc.parallelize(range(10), 2).foreach(lambda x: total.add(x))
    print(
        json.dumps(
            {
                "setting": sc.getConf().get(UNIX_SOCKETS),
                "accumulator_tcp": None if accumulator_tcp is None else list(accumulator_tcp),
                "attacked": attacked,
                "metric": result.summary["metric_value"],
                "rows": rows,
                "accumulated": total.value,
            }
        ),
        flush=True,
    )
    for sock in held:
        sock.close()
    spark.stop()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "local[2]")
