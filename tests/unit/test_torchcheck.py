"""Issue 31, point 6: a torch below 2.6, whose ``torch.load(weights_only=True)`` has known
bypasses (CVE-2025-32434), is refused when sparktrain is imported."""

from __future__ import annotations

import importlib
import importlib.metadata
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

import sparktrain
from sparktrain import torchcheck
from sparktrain.torchcheck import UnsafeTorchError, check_torch, installed_torch_version, release

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("version", ["2.5.1", "2.5.1+cpu", "2.3.0", "1.13.1", "2.0.0a0+git1234"])
def test_torch_below_2_6_is_refused_with_what_to_do(version: str) -> None:
    with pytest.raises(UnsafeTorchError, match=r"torch >= 2\.6.*CVE-2025-32434.*pip install"):
        check_torch(version)


@pytest.mark.parametrize("version", ["2.6.0", "2.6.0+cu124", "2.13.0+cpu", "3.0.0", "10.1"])
def test_torch_2_6_and_later_pass(version: str) -> None:
    check_torch(version)


@pytest.mark.parametrize("version", ["", "nightly", "2"])
def test_a_version_it_cannot_read_is_let_through(version: str) -> None:
    assert release(version) is None
    check_torch(version)


def test_the_imported_torchs_version_is_the_one_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(__version__="2.5.1"))
    assert installed_torch_version() == "2.5.1"
    with pytest.raises(UnsafeTorchError, match="found torch 2.5.1"):
        check_torch()


def test_importing_sparktrain_refuses_an_old_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(__version__="2.4.0"))
    with pytest.raises(UnsafeTorchError, match="found torch 2.4.0"):
        importlib.reload(sparktrain)
    monkeypatch.undo()
    importlib.reload(sparktrain)  # the real torch again: the package imports


def test_the_installed_version_is_read_without_importing_torch() -> None:
    probe = (
        "import sys; from sparktrain.torchcheck import installed_torch_version as v; "
        "print(v(), 'torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=REPO
    ).stdout.split()
    assert out == [importlib.metadata.version("torch"), "False"]  # as pip installed it


def test_setup_cfg_asks_for_the_same_floor() -> None:
    text = (REPO / "setup.cfg").read_text()
    floor = re.search(r"^\s*torch>=(\d+)\.(\d+)\s*$", text, re.MULTILINE)
    assert floor is not None
    assert (int(floor.group(1)), int(floor.group(2))) == torchcheck.SAFE_TORCH
