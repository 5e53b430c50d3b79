"""The strategy registry and the driver/worker halves, without Spark."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from sparktrain import costmodel, strategies
from sparktrain.config import TrainConfig
from sparktrain.driver.job import check_job
from sparktrain.errors import ConfigError
from sparktrain.strategies import registry
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
        check_job(TrainConfig(strategy="toy_for_registry_tests", compression="delta+int8"))
    with pytest.raises(ConfigError, match="per-layer table"):
        check_job(TrainConfig(strategy="toy_for_registry_tests", compression={"*": "fp16"}))


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
        check_job(TrainConfig(num_workers=2, **options))


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


class _CudaToy(Strategy):
    """A plug-in that says it reads gradients from device memory, and nothing else."""

    name = "toy_with_cuda_only"
    supports_cuda = True


ABILITIES = {
    "supports_run": ["ring", "tree", "ps"],
    "supports_torch_run": ["ring", "tree"],
    "supports_cuda": ["ring", "tree", "auto"],
    "supports_sharding": ["ring", "tree"],
    "torch_backend": ["ring", "tree"],
    "compression_paths": ["ring", "tree", "auto"],
    "auto_compression": ["ring", "tree", "auto"],
}


@pytest.mark.parametrize("ability", sorted(ABILITIES))
def test_the_builtins_abilities_are_their_class_attributes(ability):
    builtins = strategies.names()[:5]
    assert [n for n in registry.having(ability) if n in builtins] == ABILITIES[ability]


def test_every_check_asks_the_plugin_not_a_list_of_names(monkeypatch):
    """A plug-in's own attributes decide; the errors list the strategies that can."""
    from sparktrain.task.device import device_for

    # registered for this test only: other tests' error messages list the built-ins
    monkeypatch.setattr(registry, "_REGISTERED", dict(registry._REGISTERED))
    register(_CudaToy())
    cuda = TrainConfig(strategy="toy_with_cuda_only", device="cuda")
    check_job(cuda)  # accepted: it can
    assert device_for(cuda) == "cuda"
    assert "'toy_with_cuda_only'" in registry.spelled(registry.having("supports_cuda"))
    with pytest.raises(ConfigError, match=r"strategy='ring', 'tree' or 'ps', not "):
        check_job(cuda, "run")  # supports_run is False on the plug-in
    with pytest.raises(ConfigError, match="shard_optimizer=true needs strategy='ring' or 'tree'"):
        check_job(TrainConfig(strategy="toy_with_cuda_only", shard_optimizer=True))
    with pytest.raises(ConfigError, match="comm_backend='torch' averages the gradients of "):
        check_job(TrainConfig(strategy="toy_with_cuda_only", comm_backend="torch"))
    with pytest.raises(ConfigError, match="has no such choice"):
        check_job(
            TrainConfig(
                strategy="toy_with_cuda_only", compression="fp16", compression_path="allgather"
            )
        )


def test_an_ability_list_reads_as_an_error_lists_it():
    assert registry.spelled(["ring"]) == "'ring'"
    assert registry.spelled(["ring", "tree", "ps"]) == "'ring', 'tree' or 'ps'"


def test_the_registry_imports_no_plugin():
    """The built-ins register as their package imports them; a registry that imported
    a strategy by name would hide an import loop from the graph check."""
    import ast
    from pathlib import Path

    tree = ast.parse(Path(registry.__file__).read_text())
    tree.body = [  # what runs: not the type checker's imports
        n
        for n in tree.body
        if not (isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test))
    ]
    imported = [
        n.module if isinstance(n, ast.ImportFrom) else a.name
        for n in ast.walk(tree)
        if isinstance(n, ast.Import | ast.ImportFrom)
        for a in n.names
    ]
    assert not [m for m in imported if m and m.startswith(("sparktrain.strategies", "importlib"))]
    assert "import_module" not in Path(registry.__file__).read_text()
    assert registry.names()[:5] == ["ring", "tree", "auto", "ps", "tree_aggregate"]
