"""The package stays light for its users: ``import sparktrain`` and the command line's help
import neither torch nor pyspark (seconds of start-up), and a missing extra (scikit-learn,
matplotlib) gets an error that names it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sparktrain import datasets
from sparktrain.errors import ConfigError

HEAVY = ("torch", "pyspark", "sklearn", "matplotlib")

# Run `main(argv)` in a fresh interpreter (catching --help's SystemExit), then print which of
# the heavy modules it imported.
PROBE = """
import json, sys
argv = json.loads(sys.argv[1])
if argv is None:
    import sparktrain
else:
    from sparktrain.cli import main
    try:
        main(argv)
    except SystemExit:
        pass
print(json.dumps([m for m in {heavy!r} if m in sys.modules]))
"""


def heavy_imports(argv: list[str] | None) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(heavy=HEAVY), json.dumps(argv)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    result: list[str] = json.loads(out.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize(
    "argv",
    [None, ["--help"], ["train", "--help"], ["bench", "--help"]],
    ids=["import", "help", "train-help", "bench-help"],
)
def test_help_and_import_load_neither_torch_nor_pyspark(argv: list[str] | None) -> None:
    assert heavy_imports(argv) == []


FOLDERS = ("allreduce", "ps", "tree_aggregate")

# Every built-in strategy looked up, as the config's checks and the executors do, then
# which heavy modules and which modules of the strategy folders that imported.
PLUG_INS = """
import json, sys
from sparktrain.strategies import registry
for name in registry.names():
    registry.get(name)
folders = tuple(f"sparktrain.strategies.{f}." for f in %r)
halves = [m for m in sys.modules if m.startswith(folders)]
print(json.dumps({"heavy": [m for m in %r if m in sys.modules], "halves": sorted(halves)}))
"""


def test_looking_up_a_strategy_loads_its_plug_in_alone() -> None:
    # the registry imports a strategy folder by its name: the package re-exports the plug-in
    # (strategy.py) and nothing else; the driver and task halves load when a job runs
    out = subprocess.run(
        [sys.executable, "-c", PLUG_INS % (FOLDERS, HEAVY)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    found = json.loads(out.strip().splitlines()[-1])
    assert found["halves"] == [f"sparktrain.strategies.{f}.strategy" for f in FOLDERS]
    assert "pyspark" not in found["heavy"]


def test_missing_sklearn_names_the_datasets_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "sklearn" or m.startswith("sklearn.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "sklearn", None)  # import of sklearn now fails
    with pytest.raises(ConfigError, match=r"sparktrain\[datasets\]"):
        datasets.digits()
