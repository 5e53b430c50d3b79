"""The session-start warm-up of the Python workers (no Spark: a stand-in session)."""

from __future__ import annotations

from typing import Any

from sparktrain.driver import warmup


class _Session:
    """What warmup.start touches: sparkContext's job description and
    range().mapInArrow()._jdf.javaRDD().countAsync()."""

    def __init__(self, app: str, fail: bool = False) -> None:
        self.sparkContext = self
        self.applicationId = app
        self.fail = fail
        self.jobs: list[str | None] = []
        self.props: dict[str, str | None] = {"spark.job.description": "the user's"}

    def getLocalProperty(self, key: str) -> str | None:
        return self.props.get(key)

    def setLocalProperty(self, key: str, value: str | None) -> None:
        self.props[key] = value

    def setJobDescription(self, text: str) -> None:
        self.props["spark.job.description"] = text

    def range(self, n: int, numPartitions: int) -> Any:
        session = self

        class _Jvm:
            def javaRDD(self) -> Any:
                return self

            def countAsync(self) -> None:  # submitted, not waited for
                if session.fail:
                    raise RuntimeError("no executors")
                session.jobs.append(session.props["spark.job.description"])

        class _Frame:
            _jdf = _Jvm()

            def mapInArrow(self, fn: Any, schema: str) -> Any:
                assert list(fn(iter(["batch"]))) == ["batch"]  # passes its input through
                assert schema == "id long"
                return self

        return _Frame()


def test_one_warm_up_job_per_application_and_the_description_is_restored() -> None:
    spark = _Session("app-warm-1")
    assert warmup.start(spark)  # type: ignore[arg-type]
    assert not warmup.start(spark)  # type: ignore[arg-type]
    assert spark.jobs == ["sparktrain: start the Python workers"]
    assert spark.props["spark.job.description"] == "the user's"
    assert warmup.start(_Session("app-warm-2"))  # type: ignore[arg-type]


def test_a_failed_warm_up_is_swallowed() -> None:
    spark = _Session("app-warm-3", fail=True)
    assert not warmup.start(spark)  # type: ignore[arg-type]
    assert spark.jobs == [] and spark.props["spark.job.description"] == "the user's"


def test_the_session_preload_skips_a_failing_module_and_imports_the_rest() -> None:
    import subprocess
    import sys

    from sparktrain import session

    assert session.PRELOAD[0] == "torch"  # the most needed first
    code = (
        "import sys; from sparktrain import session; "
        "session._preload(('sparktrain_no_such_module', 'sparktrain.errors', 'colorsys')); "
        "assert 'colorsys' in sys.modules and 'sparktrain_no_such_module' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
