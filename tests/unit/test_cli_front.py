"""The command line's front door: --version, the default master, ./dev's help."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sparktrain import __version__
from sparktrain.cli import default_master, main

ROOT = Path(__file__).resolve().parents[2]


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"sparktrain {__version__}"


def test_default_master_gives_one_slot_per_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYSPARK_GATEWAY_PORT", raising=False)
    monkeypatch.delenv("SPARK_REMOTE", raising=False)
    assert default_master(2) == "local[2]"
    assert default_master(4) == "local[4]"


@pytest.mark.parametrize("var", ["PYSPARK_GATEWAY_PORT", "SPARK_REMOTE"])
def test_default_master_leaves_spark_submit_and_connect_alone(
    monkeypatch: pytest.MonkeyPatch, var: str
) -> None:
    monkeypatch.setenv(var, "1")
    assert default_master(2) is None


def test_train_help_states_the_real_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "local[N] with N = num_workers" in help_text


def test_dev_without_a_command_prints_only_its_usage() -> None:
    done = subprocess.run(
        ["bash", str(ROOT / "dev")], capture_output=True, text=True, timeout=30, check=False
    )
    assert done.returncode == 2
    assert "./dev test" in done.stdout
    assert "set -euo" not in done.stdout


def test_a_strategy_typo_gets_a_suggestion_and_case_is_ignored() -> None:
    from sparktrain import TrainConfig
    from sparktrain.errors import ConfigError

    with pytest.raises(ConfigError, match="Did you mean 'ring'"):
        TrainConfig(strategy="rign")
    assert TrainConfig(strategy="Ring").strategy == "ring"
    assert TrainConfig(strategy="TREE_AGGREGATE").strategy == "tree_aggregate"


def test_a_compressor_typo_gets_a_suggestion() -> None:
    from sparktrain import TrainConfig
    from sparktrain.errors import ConfigError

    with pytest.raises(ConfigError, match="Did you mean 'topk'"):
        TrainConfig(compression="topkk:0.01")


def test_a_module_instance_as_model_fn_says_to_pass_a_factory() -> None:
    from torch import nn

    from sparktrain.builders import resolve_model_fn
    from sparktrain.errors import ConfigError

    with pytest.raises(ConfigError, match=r"Linear instance; pass a factory"):
        resolve_model_fn(nn.Linear(2, 2))


@pytest.mark.parametrize("kind", ["pandas", "numpy", "list"])
def test_a_pandas_frame_is_refused_with_the_call_that_converts_it(kind: str) -> None:
    import numpy as np
    import pandas as pd

    from sparktrain.driver.prepare import prepare
    from sparktrain.errors import DataError
    from sparktrain.ml.model import require_spark_frame

    data = {"pandas": pd.DataFrame({"x": [1.0]}), "numpy": np.zeros(2), "list": [1]}[kind]
    expected = {"pandas": r"createDataFrame\(pandas_df\)", "numpy": "to_dataframe", "list": "rows"}
    with pytest.raises(DataError, match=expected[kind]):
        require_spark_frame(data, "fit's dataset")
    with pytest.raises(DataError, match=expected[kind]):
        prepare(data, None, "features", "label", 2)


def test_gpu_smoke_without_a_gpu_points_to_dry_run() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the smoke test would run for real")
    done = subprocess.run(
        [sys.executable, str(ROOT / "jobs" / "gpu_smoke.py")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 2
    assert "--dry-run" in done.stderr
    assert "Py4J" not in done.stderr and "Traceback" not in done.stderr
