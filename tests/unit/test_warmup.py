"""The session-start warm-up of the Python workers (no Spark: a stand-in session)."""

from __future__ import annotations

from typing import Any

from sparktrain.launch import warmup


class _Session:
    """Just what warmup.start touches: sparkContext and range().mapInArrow().collect()."""

    def __init__(self, app: str, fail: bool = False) -> None:
        self.sparkContext = self
        self.applicationId = app
        self.fail = fail
        self.jobs: list[str] = []
        self.description = ""

    def setJobDescription(self, text: str) -> None:
        self.description = text

    def range(self, n: int, numPartitions: int) -> Any:
        session = self

        class _Frame:
            def mapInArrow(self, fn: Any, schema: str) -> Any:
                assert list(fn(iter(["batch"]))) == ["batch"]  # passes its input through
                assert schema == "id long"
                return self

            def collect(self) -> list[Any]:
                if session.fail:
                    raise RuntimeError("no executors")
                session.jobs.append(session.description)
                return []

        return _Frame()


def test_one_warm_up_job_per_application() -> None:
    spark = _Session("app-warm-1")
    first = warmup.start(spark)  # type: ignore[arg-type]
    assert first is not None
    first.join(timeout=10)
    assert warmup.start(spark) is None  # type: ignore[arg-type]
    assert spark.jobs == ["sparktrain: start the Python workers"]
    other = warmup.start(_Session("app-warm-2"))  # type: ignore[arg-type]
    assert other is not None
    other.join(timeout=10)


def test_a_failed_warm_up_is_swallowed() -> None:
    spark = _Session("app-warm-3", fail=True)
    thread = warmup.start(spark)  # type: ignore[arg-type]
    assert thread is not None
    thread.join(timeout=10)
    assert not thread.is_alive() and spark.jobs == []
