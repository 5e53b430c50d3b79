import pytest

from sparktrain.errors import ResourceError
from sparktrain.launch.resources import check_can_launch


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
