"""A strategy plug-in written outside the package trains digits: one module, one
``register()``, shipped to the executors with ``addPyFile``; nothing else changes. It
trains under ``Trainer.fit`` and, as it declares ``supports_run``, under
``sparktrain.run`` with a ``train_fn`` of its own loop (``ctx.distributed``)."""

from __future__ import annotations

import importlib
import sys
import textwrap

import pytest

import sparktrain
from sparktrain import TrainConfig, Trainer, strategies
from sparktrain.errors import ConfigError

from .fixtures import DIGITS_MODEL, accuracy, digits, digits_frames, fast_config

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]

# All-gather every rank's sample-weighted gradient, then average: the naive exchange the
# ring is an optimisation of, so both must train the same model.
TOY_MODULE = textwrap.dedent(
    '''
    """Toy strategy: all-gather every gradient in float64, average on every rank."""

    from __future__ import annotations

    import numpy as np
    import torch

    from sparktrain.wire.ring import ring_allgather
    from sparktrain.builders import build_optimizer
    from sparktrain.strategies import register
    from sparktrain.strategies.base import Strategy


    class AllgatherMeanSync:
        def __init__(self, ctx, model, mesh):
            cfg = ctx.job.config
            self.params = [p for p in model.parameters() if p.requires_grad]
            self.mesh = mesh
            self.optimizer = build_optimizer(
                cfg.optimizer, self.params, cfg.lr, dict(cfg.optimizer_kwargs)
            )
            self.exchanges = 0

        def begin_step(self, count):
            pass

        def step(self, count):
            grads = [
                (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                for p in self.params
            ]
            mine = np.append(torch.cat(grads).double().numpy() * count, float(count))
            blobs = ring_allgather(self.mesh, mine.view(np.uint8), max_bytes=mine.nbytes)
            total = sum(np.frombuffer(b, dtype=np.float64) for b in blobs)
            self.exchanges += 1
            if total[-1] > 0:
                mean = torch.from_numpy(total[:-1] / total[-1]).float()
                offset = 0
                for p in self.params:
                    p.grad = mean[offset : offset + p.numel()].reshape(p.shape).clone()
                    offset += p.numel()
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

        def stats(self):
            return {"allgather_exchanges": self.exchanges}

        def close(self):
            pass


    class AllgatherMean(Strategy):
        name = "allgather_mean"
        supports_run = True  # sparktrain.run's ctx.distributed may step through it

        def worker_sync(self, ctx, model, mesh):
            return AllgatherMeanSync(ctx, model, mesh)


    register(AllgatherMean())
    '''
)


@pytest.fixture()
def toy_strategy(spark, tmp_path):  # type: ignore[no-untyped-def]
    path = tmp_path / "toy_allgather_mean.py"
    path.write_text(TOY_MODULE)
    spark.sparkContext.addPyFile(str(path))  # the executors import it from here
    sys.path.insert(0, str(tmp_path))
    try:
        yield importlib.import_module("toy_allgather_mean")
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("toy_allgather_mean", None)


def test_an_unregistered_strategy_names_the_registered_ones():
    with pytest.raises(ConfigError, match="registered strategies: ring, tree, auto, ps"):
        fast_config(strategy="allgather_median")


def test_a_registered_plugin_trains_digits_like_the_ring(spark, toy_strategy):
    assert "allgather_mean" in strategies.names()
    train, test = digits_frames(spark)
    cfg = fast_config(epochs=5, strategy="allgather_mean")
    toy = Trainer(DIGITS_MODEL, cfg, spark=spark).fit(train, validation_data=test)
    ring = Trainer(DIGITS_MODEL, cfg.replace(strategy="ring"), spark=spark).fit(
        train, validation_data=test
    )
    s = toy.summary
    assert s["strategy"] == "allgather_mean" and s["replicas_in_sync"]
    assert s["metric_value"] >= 0.9
    # the same averaged gradients (float64 sums against the ring's float32): the same run
    for mine, theirs in zip(toy.history, ring.history, strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-3)
    split = digits()
    assert accuracy(toy.model, split.x_test, split.y_test) == pytest.approx(
        accuracy(ring.model, split.x_test, split.y_test), abs=0.01
    )


def test_a_registered_plugin_trains_a_train_fn_under_run_like_the_ring(spark, toy_strategy):
    train, test = digits_frames(spark)
    cfg = fast_config(epochs=5, lr=0.003, strategy="allgather_mean")  # the recipe's Adam

    def run(config: TrainConfig):  # type: ignore[no-untyped-def]
        # the recipe's loop: Adam through ctx.distributed, a report per epoch
        return sparktrain.run(
            "sparktrain.recipes:digits_train_fn", train, validation_data=test, config=config
        )

    toy, ring = run(cfg), run(cfg.replace(strategy="ring"))
    assert toy.summary["strategy"] == "allgather_mean"
    assert toy.history[-1]["accuracy"] >= 0.9
    for mine, theirs in zip(toy.history, ring.history, strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-3)
        assert mine["accuracy"] == pytest.approx(theirs["accuracy"], abs=0.01)
