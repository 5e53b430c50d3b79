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
