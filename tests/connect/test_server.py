"""The shared Spark Connect server itself: the client reaches it on loopback and a barrier
``mapInArrow`` stage (what sparktrain's launcher submits) runs there."""

from __future__ import annotations

import os

import pyarrow as pa
import pytest

from .fixtures import CONNECT_MODE, LOOPBACK

pytestmark = [pytest.mark.connect, pytest.mark.timeout(120)]


def _ranks(batches):  # type: ignore[no-untyped-def]
    from pyspark import BarrierTaskContext

    context = BarrierTaskContext.get()
    for _ in batches:
        pass
    yield pa.RecordBatch.from_pylist(
        [{"rank": context.partitionId(), "world": len(context.getTaskInfos())}],
        schema=pa.schema([("rank", pa.int64()), ("world", pa.int64())]),
    )


def test_the_client_reaches_the_server_on_loopback(connect_server, connect_spark):  # type: ignore[no-untyped-def]
    assert connect_server.url.startswith(f"sc://{LOOPBACK}:")
    assert type(connect_spark).__module__ == "pyspark.sql.connect.session"
    assert os.environ[CONNECT_MODE] == "1"  # on while a connect test runs
    assert connect_spark.conf.get("spark.master") == "local[2]"
    frame = connect_spark.range(0, 8, numPartitions=2)
    rows = frame.mapInArrow(_ranks, "rank long, world long", barrier=True).toArrow().to_pylist()
    assert sorted(r["rank"] for r in rows) == [0, 1] and {r["world"] for r in rows} == {2}
