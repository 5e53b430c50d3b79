"""The test sessions (tests/conftest.py starts them with sparktrain's session defaults)
run PySpark over Unix domain sockets (``spark.python.unix.domain.socket.enabled``, issue
31, point 3): the accumulator server has no TCP port, and Python workers, Arrow
collection and accumulators work, in local mode here and in local-cluster mode in
test_cluster.py (which holds the local-cluster session's tests, so that one worker starts
it once). The attack itself is tests/integration/test_accumulator_attack.py."""

from __future__ import annotations

from typing import Any

import pytest

from .fixtures import pyspark_over_unix_sockets_works

pytestmark = [pytest.mark.spark, pytest.mark.timeout(400)]


def test_local_mode_runs_pyspark_over_unix_sockets(spark: Any) -> None:
    pyspark_over_unix_sockets_works(spark)
