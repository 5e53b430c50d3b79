"""The session-start warm-up of the Python workers (no Spark: a stand-in context)."""

from __future__ import annotations

from typing import Any

from sparktrain.launch import warmup


class _Context:
    def __init__(self, app: str, fail: bool = False) -> None:
        self.applicationId = app
        self.fail = fail
        self.jobs: list[str] = []
        self.description = ""

    def setJobDescription(self, text: str) -> None:
        self.description = text

    def parallelize(self, data: list[int], slices: int) -> Any:
        ctx = self

        class _Rdd:
            def mapPartitions(self, fn: Any) -> Any:
                assert list(fn(iter(data))) == []  # the task does nothing but start
                return self

            def count(self) -> int:
                if ctx.fail:
                    raise RuntimeError("no executors")
                ctx.jobs.append(ctx.description)
                return 0

        return _Rdd()


def test_one_warm_up_job_per_application() -> None:
    sc = _Context("app-warm-1")
    first = warmup.start(sc)  # type: ignore[arg-type]
    assert first is not None
    first.join(timeout=10)
    assert warmup.start(sc) is None  # type: ignore[arg-type]
    assert sc.jobs == ["sparktrain: start the Python workers"]
    other = warmup.start(_Context("app-warm-2"))  # type: ignore[arg-type]
    assert other is not None
    other.join(timeout=10)


def test_a_failed_warm_up_is_swallowed() -> None:
    sc = _Context("app-warm-3", fail=True)
    thread = warmup.start(sc)  # type: ignore[arg-type]
    assert thread is not None
    thread.join(timeout=10)
    assert not thread.is_alive() and sc.jobs == []
