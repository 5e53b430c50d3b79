"""Plug-in compressors reach the tasks with the job (no Spark here): the registry knows
its built-ins, a job's spec carries what the driver registered beyond them
(``JobSpec.compressors``, tree_aggregate's ``RoundSpec.compressors``), and a task installs
them before it builds a compressor, whether its process ever registered them or not. A
factory of a script travels by value: a fresh interpreter builds the compressor from the
spec's bytes alone."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import subprocess
import sys
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from sparktrain.compress import registry
from sparktrain.compress.base import BaseCompressor, BucketState, Ctx, expect_parts
from sparktrain.compress.spec import Stage, check_options
from sparktrain.config import TrainConfig
from sparktrain.driver.pickling import dumps
from sparktrain.driver.prepare import PreparedData
from sparktrain.driver.stage_runner import FitJob
from sparktrain.errors import ConfigError
from sparktrain.strategies.tree_aggregate.codec import RAW_BYTES, WIRE_BYTES
from sparktrain.strategies.tree_aggregate.flat import flatten
from sparktrain.strategies.tree_aggregate.task import partition_round
from tests.unit.fixtures import (
    loop_spec,
    random_parts,
    rounds_blocks,
    rounds_cfg,
    rounds_model,
    rounds_spec,
    train_and_assemble,
)

NAME = "halves"


class Halves(BaseCompressor):
    """float16 values, by hand (not summable, so the ring all-gathers them)."""

    spec = NAME

    def compress(self, tensor: torch.Tensor, state: BucketState) -> tuple[Any, Ctx]:
        t = tensor.detach().reshape(-1).to(torch.float32)
        return (t.to(torch.float16).numpy(),), Ctx(t.numel())

    def decompress(self, payload: Any, ctx: Ctx) -> torch.Tensor:
        expect_parts(payload, (np.float16,), self.spec)
        return torch.from_numpy(payload[0].astype(np.float32))

    def payload_nbytes(self, numel: int) -> int:
        return 2 * numel


def halves(stage: Stage) -> Halves:
    check_options(stage, 0, (), ())
    return Halves()


@pytest.fixture()
def registered(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``halves`` in the registry for the test; the registry as it was afterwards."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    registry.register(NAME, halves)
    yield


def forget() -> None:
    """This process no longer knows the plug-in, as an executor's Python worker that
    never imported it."""
    registry._REGISTRY.pop(NAME)


def test_plugins_are_the_registrations_beyond_the_builtins(registered: None) -> None:
    assert registry.plugins() == {NAME: halves}
    other = registry._REGISTRY["fp16"]
    registry.register("int8", other)  # a built-in name registered again: its new factory
    assert registry.plugins() == {NAME: halves, "int8": other}


def test_install_registers_a_jobs_plugins_and_gives_builtins_back(registered: None) -> None:
    builtin_int8 = registry._REGISTRY["int8"]
    forget()
    registry.register("int8", halves)  # an earlier job's override, in a reused worker
    registry.install({NAME: halves})
    assert registry._REGISTRY[NAME] is halves
    assert registry._REGISTRY["int8"] is builtin_int8  # this job did not override it
    assert registry.build(f"{NAME}+ef").spec == f"{NAME}+ef"


def test_a_fit_jobs_spec_carries_the_driver_plugins(registered: None) -> None:
    cfg = TrainConfig(compression=f"{NAME}+ef", threads_per_worker=1, progress=False)
    job = FitJob(
        spark=None,  # type: ignore[arg-type]  # not asked: threads_per_worker is set
        prepared=PreparedData(frame=None, rdd=None, feature_width=4),
        model=torch.nn.Linear(4, 3),
        model_fn="sparktrain.models:digits_mlp",
        model_kwargs={},
        config=cfg,
        num_outputs=3,
        started=0.0,
    )
    assert job.job_spec(None).compressors == {NAME: halves}


def test_a_task_installs_the_plugins_before_it_builds_a_compressor(registered: None) -> None:
    spec = loop_spec(compression=f"{NAME}+ef")  # checked while the driver knows it
    carried = dataclasses.replace(spec, compressors=registry.plugins())
    forget()
    parts = random_parts([30, 25], width=4, classes=3)
    with pytest.raises(ConfigError, match=f"unknown compressor '{NAME}'"):
        train_and_assemble(spec, parts)  # a job without the carriage
    result = train_and_assemble(carried, parts)
    figures = result.summary["compression_by_spec"][f"{NAME}+ef"]
    assert figures["path"] == "allgather" and figures["ratio"] > 1  # a tiny model: headers


def test_a_rounds_task_installs_them_too(registered: None) -> None:
    cfg = rounds_cfg(compression=f"{NAME}+ef")
    model, blocks = rounds_model(), rounds_blocks()
    spec = rounds_spec(cfg, model, blocks, "plugin-rounds")
    carried = dataclasses.replace(spec, job_id="plugin-rounds-2", compressors=registry.plugins())
    weights = flatten([p for p in model.parameters() if p.requires_grad])
    forget()
    with pytest.raises(ConfigError, match=f"unknown compressor '{NAME}'"):
        partition_round(spec, weights, blocks[0], 0)
    payload, stats = partition_round(carried, weights, blocks[0], 0)
    assert payload.dtype == np.uint8  # a compressed message
    assert stats[WIRE_BYTES] < stats[RAW_BYTES]  # 2 bytes a value, plus a header


# a user's script: a module no other interpreter can import, so cloudpickle takes its
# functions and classes by value (as it takes __main__'s)
SCRIPT = """
import numpy as np
import torch

from sparktrain.compress import register
from sparktrain.compress.base import BaseCompressor, Ctx


class Halves(BaseCompressor):
    spec = "script_halves"

    def compress(self, tensor, state):
        t = tensor.detach().reshape(-1).to(torch.float32)
        return (t.to(torch.float16).numpy(),), Ctx(t.numel())

    def decompress(self, payload, ctx):
        return torch.from_numpy(payload[0].astype(np.float32))

    def payload_nbytes(self, numel):
        return 2 * numel


register("script_halves", lambda stage: Halves())
"""


def test_a_script_factory_travels_by_value_to_a_fresh_interpreter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    script = types.ModuleType("users_script")
    exec(compile(SCRIPT, "users_script.py", "exec"), script.__dict__)
    spec = dataclasses.replace(
        loop_spec(compression="script_halves+ef"), compressors=registry.plugins()
    )
    blob = dumps(spec)  # as the stage runner pickles it for the tasks
    # a fresh interpreter, as an executor's Python worker: only the spec's bytes
    probe = (
        "import json, pickle, sys, torch\n"
        "from sparktrain.compress import registry\n"
        "from sparktrain.compress.base import BucketState\n"
        "spec = pickle.loads(sys.stdin.buffer.read())\n"
        "known = 'script_halves' in registry.registered()\n"
        "registry.install(spec.compressors)\n"
        "comp = registry.build(spec.config.compression)\n"
        "x = torch.linspace(-1, 1, 101)\n"
        "payload, ctx = comp.compress(x, BucketState())\n"
        "error = float((comp.decompress(payload, ctx) - x).abs().max())\n"
        "print(json.dumps([known, comp.spec, payload[0].nbytes, error]))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-c", probe], input=blob, capture_output=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr.decode()
    known, built, nbytes, error = json.loads(out.stdout.decode().strip().splitlines()[-1])
    assert not known  # nothing but the spec told it
    assert built == "script_halves+ef" and nbytes == 2 * 101 and error < 1e-3
    assert pickle.loads(blob).compressors["script_halves"].__module__ == "users_script"
