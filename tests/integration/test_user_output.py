"""What the user's code prints in the tasks reaches the driver's sys.stdout/sys.stderr,
each line named by its rank, under ``sparktrain.run``, ``torch_run`` and a Trainer fit
(issue 35.5); an exception of the user's own code is reported after its first raise,
while a task whose worker dies is still retried (issue 35.6). On local[2]."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import sparktrain
from sparktrain import TrainConfig, Trainer
from sparktrain.errors import UserCodeError
from sparktrain.models import digits_mlp

from .fixtures import bounded, digits_frames, fast_config, rank_1_gives_up

pytestmark = [pytest.mark.spark, pytest.mark.timeout(400)]


def say_hello(ctx: Any) -> int:
    """Prints on both streams, a line without its newline, and returns."""
    print(f"hello from {ctx.rank} of {ctx.world_size}")
    print(f"to stderr from {ctx.rank}", file=sys.stderr)
    sys.stdout.write(f"unfinished {ctx.rank}")
    ctx.allreduce(torch.zeros(1))  # the ranks meet: both printed while the stage ran
    return ctx.rank


def test_run_prints_reach_the_driver_with_their_rank(spark, capsys):  # type: ignore[no-untyped-def]
    result = sparktrain.run(say_hello, num_workers=2, config=fast_config(), spark=spark)
    assert result.value == 0
    out, err = capsys.readouterr()
    for rank in (0, 1):
        assert f"[rank {rank}] hello from {rank} of 2\n" in out
        assert f"[rank {rank}] unfinished {rank}\n" in out
        assert f"[rank {rank}] to stderr from {rank}\n" in err


def test_stream_output_false_leaves_the_driver_quiet(spark, capsys):  # type: ignore[no-untyped-def]
    cfg = fast_config(stream_output=False)
    sparktrain.run(say_hello, num_workers=2, config=cfg, spark=spark)
    out, err = capsys.readouterr()
    assert "[rank" not in out and "[rank" not in err


def torch_hello(word: str) -> str:
    print(f"{word} from RANK {os.environ['RANK']}", flush=True)
    return word


def test_torch_run_prints_reach_the_driver(spark, capsys):  # type: ignore[no-untyped-def]
    cfg = TrainConfig(progress=False, comm_timeout=30.0)
    with bounded(spark):
        assert (
            sparktrain.torch_run(torch_hello, "hi", num_workers=2, config=cfg, spark=spark) == "hi"
        )
    out = capsys.readouterr().out
    assert "[rank 0] hi from RANK 0\n" in out and "[rank 1] hi from RANK 1\n" in out


def test_a_torch_run_script_prints_reach_the_driver(spark, capsys, tmp_path):  # type: ignore[no-untyped-def]
    script = tmp_path / "hello.py"
    script.write_text("import os, sys\nprint('script', os.environ['RANK'], sys.argv[1])\n")
    cfg = TrainConfig(progress=False, comm_timeout=30.0)
    with bounded(spark):
        sparktrain.torch_run(str(script), "x", num_workers=2, config=cfg, spark=spark)
    out = capsys.readouterr().out
    assert "[rank 0] script 0 x\n" in out and "[rank 1] script 1 x\n" in out


class TalkativeMLP(torch.nn.Module):
    """The digits MLP, saying so on its first forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = digits_mlp()
        self.said = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.said:
            self.said = True
            print(f"first forward of a batch of {x.shape[1]} features")
        return self.inner(x)


def test_a_trainer_fit_prints_reach_the_driver(spark, capsys):  # type: ignore[no-untyped-def]
    train, _ = digits_frames(spark)
    Trainer(TalkativeMLP, fast_config(epochs=1, feature_scaling=False), spark=spark).fit(train)
    out = capsys.readouterr().out
    for rank in (0, 1):
        assert f"[rank {rank}] first forward of a batch of 64 features\n" in out


class FailingMLP(torch.nn.Module):
    """The digits MLP whose first training step raises (the driver's check of the model
    runs it in eval mode), noting each raise in ``path``."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.inner = digits_mlp()
        self.path = path

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with open(self.path, "a") as f:
                f.write("raised\n")
            raise ValueError("this batch is not for me")
        return self.inner(x)


def test_a_trainer_fit_reports_its_models_error_once(spark, tmp_path):  # type: ignore[no-untyped-def]
    train, _ = digits_frames(spark)
    path = tmp_path / "raised"
    cfg = fast_config(epochs=1, feature_scaling=False, max_restarts=2)
    trainer = Trainer(FailingMLP, cfg, model_kwargs={"path": str(path)}, spark=spark)
    with pytest.raises(ValueError, match=r"rank \d raised ValueError: this batch is not for me"):
        trainer.fit(train)
    assert path.read_text().split() == ["raised", "raised"]  # each rank once: one attempt


def test_a_user_error_is_reported_after_its_first_raise(spark, tmp_path):  # type: ignore[no-untyped-def]
    attempts = tmp_path / "attempts"
    cfg = fast_config(max_restarts=2)
    with pytest.raises(ValueError, match="rank 1 raised ValueError: rank one gives up") as info:
        sparktrain.run(rank_1_gives_up(str(attempts)), num_workers=2, config=cfg, spark=spark)
    err = info.value
    assert isinstance(err, UserCodeError) and err.rank == 1 and err.type_name == "ValueError"
    assert err.user_message == "rank one gives up\nfor good"
    assert "in train_fn" in err.traceback_text and "for good" in str(err)
    assert sorted(attempts.read_text().split()) == ["0", "1"]  # one attempt, not three


def dies_once(marker: str, attempts: str) -> str:
    import torch.distributed as dist

    with open(attempts, "a") as f:
        f.write(os.environ["RANK"] + "\n")
    dist.init_process_group("gloo")
    dist.barrier()
    if os.environ["RANK"] == "1" and not os.path.exists(marker):
        Path(marker).touch()
        os._exit(137)  # the worker dies, as if killed
    dist.barrier()  # rank 0: Gloo's "connection closed by peer" the first time
    return "done"


def test_a_torch_run_worker_that_dies_is_retried(spark, tmp_path):  # type: ignore[no-untyped-def]
    attempts = tmp_path / "attempts"
    cfg = TrainConfig(progress=False, comm_timeout=30.0, max_restarts=1)
    with bounded(spark):
        value = sparktrain.torch_run(
            dies_once, str(tmp_path / "died"), str(attempts), num_workers=2, config=cfg, spark=spark
        )
    assert value == "done"
    assert sorted(attempts.read_text().split()) == ["0", "0", "1", "1"]  # two attempts
