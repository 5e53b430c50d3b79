"""Functions, classes and hooks defined in a user's script (``__main__``) reach the
tasks: ``sparktrain.run`` with the docs' ``digits_train_fn`` pasted below ``import torch``
(issue 32: ``cannot pickle 'ConfigModuleInstance' object``), and ``Trainer.fit`` with a
model factory, a ``decode`` and callbacks of the script.

The script runs in a process of its own: only there are its functions ``__main__``'s,
as a user's are (and only a script's own session sees them pickled as Spark does)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.spark

SCRIPT = textwrap.dedent(
    """
    from typing import Any

    import numpy as np
    import torch
    import torch.nn.functional as F
    from torch import nn

    import sparktrain
    from sparktrain import Trainer, TrainConfig, datasets
    from sparktrain import Callback
    from sparktrain.models import mlp
    from sparktrain.session import get_or_create_session
    from sparktrain.task.run_context import RunContext


    def digits_train_fn(ctx: RunContext) -> dict[str, Any]:  # docs/run.md's, verbatim
        cfg = ctx.config
        torch.manual_seed(cfg.seed)
        model = mlp(64, (128,), 10)
        optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
        model, optimizer = ctx.distributed(model, optimizer)
        start, state = 0, ctx.restore()
        if state is not None:  # a restarted stage continues here
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            start = state["epoch"] + 1
        for epoch in range(start, cfg.epochs):
            model.train()
            loss_sum, rows = 0.0, 0
            for batch in ctx.batches(epoch):
                with ctx.autocast():
                    loss = F.cross_entropy(model(batch.x), batch.y.long())
                ctx.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                loss_sum, rows = loss_sum + loss.item() * len(batch), rows + len(batch)
            ctx.report({"loss": loss_sum / rows, **ctx.evaluate(model, ["accuracy", "log_loss"])})
            state = {
                "model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch
            }
            ctx.checkpoint(state)
            if ctx.should_stop:
                break
        return {"model": model.state_dict(), "history": ctx.history}


    class Net(nn.Module):  # a class of the script: pickled by value too
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))

        def forward(self, image: torch.Tensor) -> torch.Tensor:
            return self.body(image)


    def model_fn() -> nn.Module:
        torch.backends.cudnn.deterministic = True  # torch.backends.cudnn: a CudnnModule
        return Net()


    def decode(raw: bytes) -> np.ndarray:
        return (np.frombuffer(raw, np.uint8).astype(np.float32) / 16.0).reshape(1, 8, 8)


    class Epochs(Callback):
        def __init__(self) -> None:
            self.seen = 0

        def on_epoch_end(self, record: dict[str, Any], history: list[dict[str, Any]]) -> None:
            self.seen += 1


    if __name__ == "__main__":
        spark = get_or_create_session("local[2]")
        split = datasets.digits()
        df = datasets.to_dataframe(spark, split.x_train, split.y_train, 2)
        test = datasets.to_dataframe(spark, split.x_test, split.y_test, 2)
        cfg = TrainConfig(epochs=3, lr=0.003, progress=False)
        out = sparktrain.run(digits_train_fn, df, validation_data=test, config=cfg, num_workers=2)
        assert len(out.history) == 3 and out.history[-1]["accuracy"] > 0.8, out.history

        rows = zip(datasets.digit_bytes(split.x_train), split.y_train.astype(float).tolist())
        images = spark.createDataFrame(list(rows), "image binary, label double").repartition(2)
        epochs, lines = Epochs(), []
        cfg = TrainConfig(
            epochs=3, lr=0.01, num_workers=2, progress=False, decode={"image": decode}
        )
        result = Trainer(model_fn, cfg).fit(
            images, features_col="image", callbacks=[epochs, lambda r, h: lines.append(len(h))]
        )
        assert epochs.seen == 3 and lines == [1, 2, 3], (epochs.seen, lines)
        assert result.history[-1]["loss"] < result.history[0]["loss"], result.history

        # tree_aggregate's rounds ship the script's model_fn in their own closure
        cfg = TrainConfig(
            epochs=2, lr=0.01, num_workers=2, progress=False, strategy="tree_aggregate",
            local_steps=64,
        )
        rounds = Trainer(model_fn, cfg).fit(df, validation_data=test)
        assert len(rounds.history) == 2, rounds.history
        spark.stop()
        print("script done")
    """
)


def test_functions_of_a_script_train(tmp_path: Path) -> None:
    script = tmp_path / "train_digits.py"
    script.write_text(SCRIPT)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), *sys.path])}
    env.setdefault("PYSPARK_PYTHON", sys.executable)
    env.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    out = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=540,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-6000:]
    assert out.stdout.strip().endswith("script done")
    assert "Traceback" not in out.stderr, out.stderr[-6000:]
