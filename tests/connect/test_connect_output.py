"""From a Spark Connect session (the shared server on loopback): what the tasks print
reaches this client's sys.stdout with its rank (the driver services run here), and an
exception of the user's code is reported after its first raise (issue 35.5/35.6)."""

from __future__ import annotations

from typing import Any

import pytest

import sparktrain
from sparktrain.errors import UserCodeError

from .fixtures import fast_config, rank_1_gives_up

pytestmark = [pytest.mark.connect, pytest.mark.timeout(300)]


def hello(ctx: Any) -> int:
    import torch

    print(f"hello from {ctx.rank}")
    ctx.allreduce(torch.zeros(1))
    return int(ctx.rank)


def test_prints_reach_the_connect_client_with_their_rank(connect_spark, capsys):  # type: ignore[no-untyped-def]
    result = sparktrain.run(hello, num_workers=2, config=fast_config(), spark=connect_spark)
    assert result.value == 0
    out = capsys.readouterr().out
    assert "[rank 0] hello from 0\n" in out and "[rank 1] hello from 1\n" in out


def test_a_user_error_is_reported_once_under_connect(connect_spark, tmp_path):  # type: ignore[no-untyped-def]
    attempts = tmp_path / "attempts"
    cfg = fast_config(max_restarts=2)
    with pytest.raises(ValueError, match="rank 1 raised ValueError: rank one gives up") as info:
        sparktrain.run(
            rank_1_gives_up(str(attempts)), num_workers=2, config=cfg, spark=connect_spark
        )
    assert isinstance(info.value, UserCodeError) and "in train_fn" in info.value.traceback_text
    assert sorted(attempts.read_text().split()) == ["0", "1"]
