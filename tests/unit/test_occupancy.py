"""``driver/occupancy.py`` without Spark: a stage's launcher cancels its job group on
every way out but success (an error, KeyboardInterrupt), and what holds the slots reads
as the jobs that hold them."""

from __future__ import annotations

import pytest

from sparktrain.driver import occupancy


class FakeEnv:
    """A Spark Connect-like env: no SparkContext, so nothing to wait for after cancelling."""

    connect = True

    def __init__(self) -> None:
        self.cancelled: list[str] = []

    def cancel_group(self, group: str) -> None:
        self.cancelled.append(group)


@pytest.mark.parametrize("exc", [KeyboardInterrupt, TimeoutError, ValueError])
def test_any_way_out_but_success_cancels_the_group(exc: type[BaseException]) -> None:
    env = FakeEnv()
    with pytest.raises(exc), occupancy.launching(env, "sparktrain-abc-0"):  # type: ignore[arg-type]
        assert "sparktrain-abc-0" in occupancy._live
        raise exc()
    assert env.cancelled == ["sparktrain-abc-0"]
    assert "sparktrain-abc-0" not in occupancy._live


def test_success_cancels_nothing() -> None:
    env = FakeEnv()
    with occupancy.launching(env, "sparktrain-abc-1"):  # type: ignore[arg-type]
        pass
    assert env.cancelled == []
    assert "sparktrain-abc-1" not in occupancy._live


def test_the_error_names_the_jobs_and_the_tasks_of_ended_ones() -> None:
    job = occupancy.ActiveJob(7, "sparktrain-abc-0", "sparktrain ring: training stage", (9,), 1)
    text = occupancy.describe([job], running=2)
    assert "job 7 group 'sparktrain-abc-0' (sparktrain ring: training stage" in text
    assert "1 task(s) of jobs that already ended" in text
    assert job.ours
    assert not occupancy.ActiveJob(8, None, "count", (10,), 1).ours
