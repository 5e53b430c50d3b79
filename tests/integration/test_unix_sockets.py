"""The test sessions (tests/conftest.py starts them with sparktrain's session defaults)
run PySpark over Unix domain sockets (``spark.python.unix.domain.socket.enabled``, issue
31, point 3): the accumulator server has no TCP port, and Python workers, Arrow
collection and accumulators work, in local mode and in local-cluster mode. The attack
itself is tests/integration/test_accumulator_attack.py."""

from __future__ import annotations

from typing import Any

import pytest

from sparktrain.driver.spark_env import UNIX_SOCKETS, tcp_accumulator_address

pytestmark = [pytest.mark.spark, pytest.mark.timeout(400)]


def _python_jobs_work(spark: Any) -> None:
    sc = spark.sparkContext
    assert sc.getConf().get(UNIX_SOCKETS) == "true"
    assert tcp_accumulator_address(sc) is None  # a Unix socket: no port to connect to
    total = sc.accumulator(0)
    sc.parallelize(range(10), 2).foreach(lambda x: total.add(x))  # workers -> accumulator
    assert total.value == 45
    assert spark.range(100).toArrow().num_rows == 100  # Arrow collection to the driver


def test_local_mode_runs_pyspark_over_unix_sockets(spark: Any) -> None:
    _python_jobs_work(spark)


def test_local_cluster_runs_pyspark_over_unix_sockets(spark_cluster: Any) -> None:
    _python_jobs_work(spark_cluster)
