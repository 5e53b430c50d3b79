import pytest

from sparktrain.errors import ResourceError
from sparktrain.launch.resources import check_can_launch, check_transport_security


class _Conf(dict):
    def get(self, key, default=None):
        return super().get(key, default)


class _FakeContext:
    master = "local[2]"

    def __init__(self, **conf):
        self._conf = _Conf(conf)

    def getConf(self):
        return self._conf


def test_dynamic_allocation_is_refused_with_a_way_out():
    sc = _FakeContext(**{"spark.dynamicAllocation.enabled": "true"})
    with pytest.raises(ResourceError, match="spark.dynamicAllocation.enabled=false"):
        check_can_launch(sc, 2)  # type: ignore[arg-type]


def test_spark_encryption_refuses_plaintext_gradients_unless_allowed(caplog):
    sc = _FakeContext(**{"spark.network.crypto.enabled": "true"})
    with pytest.raises(ResourceError, match="Set allow_unencrypted=true"):
        check_transport_security(sc, allow_unencrypted=False)  # type: ignore[arg-type]
    check_transport_security(sc, allow_unencrypted=True)  # type: ignore[arg-type]
    assert "not encrypted" in caplog.text
    check_transport_security(_FakeContext(), allow_unencrypted=False)  # type: ignore[arg-type]


# ------------------------------------------------------------------ the slot watchdog
class _Cancellable:
    master = "spark://127.0.0.1:7077"

    def __init__(self) -> None:
        self.cancelled: list[str] = []

    def getConf(self) -> _Conf:
        return _Conf({})

    def cancelJobGroup(self, group: str) -> None:
        self.cancelled.append(group)


def test_the_watchdog_cancels_a_stage_that_lost_its_slots(monkeypatch):
    import time

    from sparktrain.launch import resources

    monkeypatch.setattr(resources, "max_concurrent_tasks", lambda sc: 1)
    sc = _Cancellable()
    started = time.monotonic()
    dog = resources.SlotWatchdog(sc, 2, "grp", grace_s=0.3, poll_s=0.05)  # type: ignore[arg-type]
    while not sc.cancelled and time.monotonic() - started < 10:
        time.sleep(0.05)
    dog.stop()
    assert sc.cancelled == ["grp"]
    assert dog.reason is not None and "num_workers=2 needs 2 task slots" in dog.reason
    assert "offers 1" in dog.reason


def test_the_watchdog_waits_out_a_short_loss_and_leaves_a_full_cluster_alone(monkeypatch):
    import time

    from sparktrain.launch import resources

    seen = iter([1, 1, 2] + [2] * 1000)  # one executor briefly gone, then replaced
    monkeypatch.setattr(resources, "max_concurrent_tasks", lambda sc: next(seen))
    sc = _Cancellable()
    dog = resources.SlotWatchdog(sc, 2, "grp", grace_s=0.5, poll_s=0.05)  # type: ignore[arg-type]
    time.sleep(1.0)
    dog.stop()
    assert sc.cancelled == [] and dog.reason is None
