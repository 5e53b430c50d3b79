"""A compressor plug-in written outside the package trains digits on every path: one
module, one ``register()``, shipped to the executors with ``addPyFile``. The driver's
registry rides in the job (``JobSpec.compressors``, tree_aggregate's
``RoundSpec.compressors``) and each task installs it before it builds a compressor, so the
ring under ``Trainer.fit``, ``sparktrain.run``'s ``ctx.distributed``, tree_aggregate's
rounds and the parameter server's clients (its server is in the driver) all build it."""

from __future__ import annotations

import importlib
import sys
import textwrap

import pytest

import sparktrain
from sparktrain import Trainer, compress
from sparktrain.compress import registry

from .fixtures import DIGITS_MODEL, digits_frames, fast_config

pytestmark = [pytest.mark.spark, pytest.mark.timeout(400)]

NAME = "halfscale"
MODULE = "toy_halfscale"

# float16 after scaling each tensor to its largest magnitude: 2 bytes a value, and small
# gradients do not underflow as in plain fp16. Every rank's scale differs, so payloads do
# not sum: the ring all-gathers them, tree_aggregate decodes before it adds, the
# parameter server decodes each push.
TOY_MODULE = textwrap.dedent(
    '''
    """Toy compressor: float16 values of a tensor scaled to its largest magnitude."""

    from __future__ import annotations

    import math

    import numpy as np
    import torch

    from sparktrain.compress import register
    from sparktrain.compress.base import (
        BaseCompressor,
        Ctx,
        as_tensor,
        bad,
        expect_len,
        expect_meta,
        expect_parts,
    )
    from sparktrain.compress.spec import check_options

    TOP = 2.0**15  # the largest magnitude lands here, well inside float16's 65504


    class HalfScale(BaseCompressor):
        spec = "halfscale"
        summable = False  # each rank's scale is its own

        def compress(self, tensor, state):
            t = tensor.detach().reshape(-1).to(torch.float32)
            peak = float(t.abs().max()) if t.numel() else 0.0
            scale = peak / TOP if math.isfinite(peak) and peak > 0 else 1.0
            codes = torch.nan_to_num(t / scale, nan=0.0, posinf=TOP, neginf=-TOP)
            return (codes.to(torch.float16).numpy(),), Ctx(t.numel(), (scale,))

        def decompress(self, payload, ctx):
            expect_meta(ctx, 1, self.spec)
            expect_parts(payload, (np.float16,), self.spec)
            expect_len(payload[0], ctx.numel, "the values")
            if not ctx.meta[0] > 0:
                raise bad(f"halfscale scale {ctx.meta[0]} is not positive")
            return as_tensor(payload[0]).to(torch.float32).mul_(ctx.meta[0])

        def payload_nbytes(self, numel):
            return 2 * numel


    def halfscale(stage):
        check_options(stage, 0, (), ())  # no options
        return HalfScale()


    register("halfscale", halfscale)
    '''
)


@pytest.fixture()
def halfscale(spark, tmp_path):  # type: ignore[no-untyped-def]
    path = tmp_path / f"{MODULE}.py"
    path.write_text(TOY_MODULE)
    spark.sparkContext.addPyFile(str(path))  # the executors import it from here
    sys.path.insert(0, str(tmp_path))
    try:
        yield importlib.import_module(MODULE)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(MODULE, None)
        registry._REGISTRY.pop(NAME, None)


def fit(spark, **overrides):  # type: ignore[no-untyped-def]
    train, test = digits_frames(spark)
    cfg = fast_config(epochs=5, **overrides)
    return Trainer(DIGITS_MODEL, cfg, spark=spark).fit(train, validation_data=test).summary


def run(spark, **overrides):  # type: ignore[no-untyped-def]
    """The recipe's train_fn: its own loop, Adam through ctx.distributed."""
    train, test = digits_frames(spark)
    cfg = fast_config(epochs=5, lr=0.003, **overrides)
    result = sparktrain.run(
        "sparktrain.recipes:digits_train_fn", train, validation_data=test, config=cfg
    )
    return {**result.summary, "metric_value": result.history[-1]["accuracy"]}


def test_the_plugin_is_registered_on_the_driver_and_carried_to_the_tasks(halfscale):
    assert NAME in registry.registered()
    assert registry.plugins() == {NAME: halfscale.halfscale}  # nothing else beyond built-ins
    assert compress.build(f"{NAME}+ef").spec == f"{NAME}+ef"


def test_the_ring_under_fit(spark, halfscale):
    base = fit(spark, strategy="ring")
    mine = fit(spark, strategy="ring", compression=f"{NAME}+ef")
    assert mine["replicas_in_sync"] and mine["compression"] == f"{NAME}+ef"
    assert mine["metric_value"] >= base["metric_value"] - 0.02
    assert mine["compression_path"] == "allgather"  # not summable: the payloads go whole
    assert mine["compression_ratio"] > 1.5  # 2 bytes a value, plus headers


def test_a_train_fn_under_run(spark, halfscale):
    base = run(spark, strategy="ring")
    mine = run(spark, strategy="ring", compression=NAME)
    assert mine["metric_value"] >= base["metric_value"] - 0.02
    assert mine["compression_ratio"] > 1.5
    assert mine["wire_bytes"] < 0.7 * base["wire_bytes"]


def test_tree_aggregate_rounds(spark, halfscale):
    common = {"strategy": "tree_aggregate", "local_steps": 8}
    base = fit(spark, **common)
    mine = fit(spark, compression=f"{NAME}+ef", **common)
    assert mine["metric_value"] >= base["metric_value"] - 0.02
    assert mine["upload_bytes"] == base["upload_bytes"]  # raw: what "none" sends
    assert mine["upload_bytes"] / mine["upload_wire_bytes"] > 1.5
    assert mine["compression_ratio"] > 1.0  # the weight downloads go exact


def test_the_parameter_server(spark, halfscale):
    # delta+: the server (in the driver) compresses the pulls with it too
    common = {"strategy": "ps", "ps_shards": 2}
    base = fit(spark, **common)
    mine = fit(spark, compression=f"delta+{NAME}", **common)
    assert mine["replicas_in_sync"]
    assert mine["metric_value"] >= base["metric_value"] - 0.02
    assert mine["ps"]["push"]["payload_ratio"] > 1.5  # the clients' (the tasks') pushes
    assert mine["ps"]["pull"]["payload_ratio"] > 1.5
    assert mine["compression_ratio"] > 1.5


def test_a_compressor_of_a_script_travels_by_value(spark, tmp_path):
    """Defined in a script or a notebook, a compressor's factory and class travel by
    value (``register_pickle_by_value`` pickles this module's code as ``__main__``'s is
    pickled): no file is shipped and no executor imports the module, so only the job's
    carriage registers it there (tree_aggregate's ``RoundSpec``, a barrier stage's
    ``JobSpec``); a name of its own, so no Python worker knows it from a test above."""
    from pyspark import cloudpickle

    name = "halfscale_byvalue"
    path = tmp_path / f"toy_{name}.py"
    path.write_text(TOY_MODULE.replace("halfscale", name))
    sys.path.insert(0, str(tmp_path))  # the driver's only: an executor could not import it
    try:
        module = importlib.import_module(f"toy_{name}")
        cloudpickle.register_pickle_by_value(module)
        try:
            rounds = fit(spark, strategy="tree_aggregate", local_steps=8, compression=f"{name}+ef")
            ring = run(spark, strategy="ring", compression=name)
        finally:
            cloudpickle.unregister_pickle_by_value(module)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(f"toy_{name}", None)
        registry._REGISTRY.pop(name, None)
    # the uncompressed runs of the tests above reach 0.876 and 0.929
    assert rounds["metric_value"] >= 0.85
    assert rounds["upload_bytes"] / rounds["upload_wire_bytes"] > 1.5
    assert ring["metric_value"] >= 0.9 and ring["compression_ratio"] > 1.5
