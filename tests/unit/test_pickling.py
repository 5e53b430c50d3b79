"""How a job's spec travels to its tasks (:mod:`sparktrain.driver.pickling`): functions
of a script or notebook (pickled by value) whose names reach a module of a ``ModuleType``
subclass (``torch.distributed.config``, ``torch.backends.cudnn``), and the error that
names an unpicklable part."""

from __future__ import annotations

import dataclasses
import os
import pickle
import subprocess
import sys
import threading
import types

import pytest
from pyspark import cloudpickle
from pyspark.serializers import CloudPickleSerializer

from sparktrain.driver.pickling import dumps, shippable
from sparktrain.errors import ConfigError
from sparktrain.task.context import JobSpec
from tests.unit.fixtures import loop_spec

# a user's script, as cloudpickle sees one: a module it cannot import, so its functions
# go by value with the globals they name (the functions of __main__ do the same)
SCRIPT = """
import torch

def train_fn(ctx):
    cfg = ctx.config                      # "config" and "distributed" are attribute
    model = ctx.distributed(torch.nn.Linear(2, 1))  # names: torch.distributed.config
    return cfg, model

def model_fn():
    torch.backends.cudnn.deterministic = True     # torch.backends.cudnn: CudnnModule
    return torch.nn.Linear(4, 3)
"""


def user_script() -> types.ModuleType:
    module = types.ModuleType("users_script")
    exec(compile(SCRIPT, "users_script.py", "exec"), module.__dict__)
    return module


def test_spark_own_pickler_fails_on_a_script_function_that_reaches_a_config_module() -> None:
    """The bug (cloudpipe/cloudpickle issue 405), as Spark's serializer meets it."""
    script = user_script()
    with pytest.raises(TypeError, match="cannot pickle 'ConfigModuleInstance'"):
        cloudpickle.dumps(script.train_fn)
    with pytest.raises(TypeError, match="cannot pickle 'CudnnModule'"):
        cloudpickle.dumps(script.model_fn)


def test_dumps_pickles_those_modules_by_reference_and_the_function_runs_elsewhere() -> None:
    script = user_script()
    blob = dumps((script.train_fn, script.model_fn))
    # a fresh interpreter, as an executor's: the functions load and run
    probe = (
        "import pickle, sys, torch\n"
        "train_fn, model_fn = pickle.loads(sys.stdin.buffer.read())\n"
        "class Ctx:\n"
        "    config = 'cfg'\n"
        "    def distributed(self, m): return m\n"
        "cfg, model = train_fn(Ctx())\n"
        "assert cfg == 'cfg' and isinstance(model, torch.nn.Linear)\n"
        "assert model_fn().out_features == 3 and torch.backends.cudnn.deterministic\n"
        "print('ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-c", probe], input=blob, capture_output=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr.decode()
    assert out.stdout.decode().strip() == "ok"


def test_a_shippable_spec_pickles_through_spark_serializer_as_the_plain_spec() -> None:
    script = user_script()
    spec = dataclasses.replace(loop_spec(), train_fn=script.train_fn, model_fn=script.model_fn)
    shipped = shippable(spec)
    assert isinstance(shipped, JobSpec) and shipped.config == spec.config  # the driver's view
    loaded = pickle.loads(CloudPickleSerializer().dumps(shipped))
    assert type(loaded) is JobSpec
    assert loaded.job_id == spec.job_id and loaded.config == spec.config
    assert loaded.model_fn().out_features == 3
    # a replace() of a shipped spec pickles afresh, with its own change
    again = pickle.loads(CloudPickleSerializer().dumps(dataclasses.replace(shipped, attempt=3)))
    assert type(again) is JobSpec and again.attempt == 3


def test_an_unpicklable_part_fails_on_the_driver_by_its_name() -> None:
    lock = threading.Lock()

    def train_fn(ctx: object) -> object:
        with lock:  # a lock cannot travel
            return None

    with pytest.raises(ConfigError, match=r"^train_fn cannot be pickled .*lock.*importable"):
        shippable(dataclasses.replace(loop_spec(), train_fn=train_fn))
    spec = loop_spec()
    cfg = spec.config.replace(decode={"image": lambda raw: lock})
    with pytest.raises(ConfigError, match=r"^config\.decode\['image'\] cannot be pickled"):
        shippable(dataclasses.replace(spec, config=cfg))
