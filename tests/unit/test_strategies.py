"""The strategy registry and the driver/worker halves, without Spark."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from sparktrain import costmodel, strategies
from sparktrain.config import TrainConfig
from sparktrain.errors import ConfigError
from sparktrain.strategies.base import DriverHalf, Strategy
from sparktrain.strategies.registry import is_known, register

from .fixtures import loop_spec


class _Toy(Strategy):
    name = "toy_for_registry_tests"


class _OtherToy(Strategy):
    name = "toy_for_registry_tests"


def test_builtin_names_come_first_and_import_on_first_use():
    assert strategies.names()[:5] == ["ring", "tree", "auto", "ps", "tree_aggregate"]
    assert strategies.get("ring").launcher == "barrier"
    assert strategies.get("tree_aggregate").launcher == "rounds"


def test_an_unknown_name_lists_the_registered_ones():
    with pytest.raises(ConfigError, match="registered strategies: ring, tree, auto, ps") as err:
        strategies.get("carrier_pigeon")
    assert "did you forget to import" in str(err.value).lower()
    with pytest.raises(ConfigError, match="carrier_pigeon"):
        TrainConfig(strategy="carrier_pigeon")


def test_registering_is_idempotent_but_a_taken_name_is_refused():
    register(_Toy())
    register(_Toy())  # a module imported again (a reused Python worker) is fine
    assert is_known("toy_for_registry_tests")
    with pytest.raises(ConfigError, match="already registered"):
        register(_OtherToy())

    class Nameless(Strategy):
        name = "not an identifier"

    with pytest.raises(ConfigError, match="identifier"):
        register(Nameless())


def test_a_plugin_gets_the_default_halves():
    register(_Toy())
    toy = strategies.get("toy_for_registry_tests")
    cfg = TrainConfig(strategy="toy_for_registry_tests", num_workers=2)
    assert toy.opens_sockets(cfg) and toy.executors_write_checkpoints
    with pytest.raises(ConfigError, match="does not run in a barrier stage"):
        toy.worker_sync(None, None, None)  # type: ignore[arg-type]
    with pytest.raises(NotImplementedError, match="no cost model"):
        toy.comm_s(1e6, 2, 1e-4, 1e-9)
    with pytest.raises(ConfigError, match="drop 'delta"):
        TrainConfig(strategy="toy_for_registry_tests", compression="delta+int8")
    with pytest.raises(ConfigError, match="per-layer table"):
        TrainConfig(strategy="toy_for_registry_tests", compression={"*": "fp16"})


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"strategy": "ps", "compression": "auto"}, "compression='auto' is chosen inside"),
        ({"strategy": "tree_aggregate", "compression": "auto"}, "with strategy='tree_aggregate'"),
        ({"strategy": "ps", "compression": {"*": "int8"}}, "per-layer table"),
        ({"strategy": "ps", "parallelism_pipeline": 2}, "does not combine with parallelism"),
        ({"strategy": "auto", "parallelism_pipeline": 2}, "'auto' do not combine"),
        ({"strategy": "ring", "compression": "auto", "parallelism_pipeline": 2}, "do not combine"),
        ({"strategy": "ps", "compression": "delta+powersgd:2"}, "delta\\+powersgd cannot"),
        ({"strategy": "tree_aggregate", "compression": "delta+powersgd:2"}, "delta\\+powersgd"),
    ],
)
def test_each_strategy_refuses_what_it_cannot_run(options, needle):
    with pytest.raises(ConfigError, match=needle):
        TrainConfig(num_workers=2, **options)


def test_what_each_strategy_accepts():
    TrainConfig(strategy="ps", compression="delta+int8+ef")  # pulls are deltas
    TrainConfig(strategy="tree_aggregate", compression="delta+int8+ef")  # downloads
    TrainConfig(strategy="ring", compression={"fc.*": "fp16", "*": "int8+ef"})
    TrainConfig(strategy="tree", parallelism_pipeline=2, num_workers=2)
    assert not strategies.get("tree_aggregate").opens_sockets(
        TrainConfig(strategy="tree_aggregate", compression="int8")
    )
    assert strategies.get("tree_aggregate").opens_sockets(
        TrainConfig(strategy="tree_aggregate", compression="delta+int8")
    )


@pytest.mark.parametrize("name", ["ring", "tree", "ps"])
def test_each_strategy_gives_the_cost_model_its_own_term(name):
    got = strategies.get(name).comm_s(4e6, 4, 5e-5, 1e-9, buckets=3)
    assert got == costmodel.comm_s(name, 4e6, 4, 5e-5, 1e-9, buckets=3)


def test_auto_predicts_the_faster_of_ring_and_tree():
    args = (4e6, 4, 5e-5, 1e-9)
    ring, tree = (costmodel.comm_s(s, *args) for s in ("ring", "tree"))
    assert strategies.get("auto").comm_s(*args) == min(ring, tree)


def test_the_strategy_travels_in_the_job_spec_by_reference():
    spec = dataclasses.replace(loop_spec(), strategy=strategies.get("ring"))
    back = pickle.loads(pickle.dumps(spec))
    assert type(back.strategy) is type(strategies.get("ring"))
    assert back.plugin().name == "ring"
    # a stage that chose for itself (auto -> tree) finds the chosen one in the registry
    auto = dataclasses.replace(loop_spec(strategy="auto"), strategy=strategies.get("auto"))
    resolved = dataclasses.replace(auto, config=auto.config.replace(strategy="tree"))
    assert resolved.plugin() is strategies.get("tree")


def test_the_default_driver_half_has_no_services():
    half = DriverHalf(job=None)  # type: ignore[arg-type]
    spec = loop_spec()
    assert half.job_spec(spec) is spec
    assert half.resume_source(3) == "from the checkpoint of step 3"
