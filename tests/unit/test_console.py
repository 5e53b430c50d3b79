"""The console helpers that need no Spark (tests/integration/test_console.py runs the
rest in a subprocess)."""

from __future__ import annotations

from sparktrain.driver import console
from sparktrain.driver.prepare import _PYTHON_PLAN, _first_of_partition


def test_outside_spark_submit_the_session_gets_no_extra_setting(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("PYSPARK_GATEWAY_PORT", raising=False)
    assert console.submitted_driver_conf() == {}


def test_the_first_row_of_a_partition_is_read_to_its_end() -> None:
    rows = iter([(1,), (2,), (3,)])
    assert _first_of_partition(rows) == [(1,)]
    assert next(rows, None) is None  # the producer is never left writing
    assert _first_of_partition(iter([])) == []


def test_plans_that_run_python_are_told_apart() -> None:
    assert _PYTHON_PLAN.search("*(1) Scan ExistingRDD[features#0,label#1]")
    assert _PYTHON_PLAN.search("MapInArrow <lambda>(id#0L)#2, [x#3L], false")
    assert _PYTHON_PLAN.search("ArrowEvalPython [f(x#1)#5], [pythonUDF0#9], 200")
    assert not _PYTHON_PLAN.search("LocalTableScan [features#0, label#1]")
    assert not _PYTHON_PLAN.search("FileScan parquet [features#0,label#1] Batched: true")
