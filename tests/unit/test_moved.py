"""Moved modules (:mod:`sparktrain._moved`): every old dotted name still imports, as the new
module object itself and with a DeprecationWarning that names the new one, for one
release; pickles made under an old name still load; and nothing of the checkout imports
an old name any more."""

from __future__ import annotations

import ast
import importlib
import pickle
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from sparktrain import _moved
from sparktrain._moved import MOVED, message

REPO = Path(__file__).resolve().parents[2]
# what the checkout must import by the new names: this file imports the old ones on purpose
SCANNED = ("sparktrain", "benchmarks", "jobs", "tests")
THIS = Path(__file__).resolve()


def _is_package(name: str) -> bool:
    spec = importlib.util.find_spec(name)
    return spec is not None and spec.submodule_search_locations is not None


OLD_PACKAGES = sorted(old for old, new in MOVED.items() if _is_package(new))


@pytest.mark.parametrize("old", sorted(set(MOVED) - set(OLD_PACKAGES)))
def test_an_old_name_is_the_new_module_with_a_warning(
    old: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    new = MOVED[old]
    monkeypatch.delitem(sys.modules, old, raising=False)  # imported by an earlier test
    parent = old.rpartition(".")[0]
    if parent in MOVED:  # an old package: its own warning is its own test's
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            importlib.import_module(parent)
    with pytest.warns(DeprecationWarning, match=re.escape(message(old))) as caught:
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert sys.modules[old] is sys.modules[new]
    # the new module keeps its own identity: name, spec (reload, -m) and file
    assert module.__name__ == new
    assert module.__spec__ is not None and module.__spec__.name == new
    assert module.__file__ is not None and "/".join(new.split(".")) in module.__file__
    # the warning points at the line that imported the old name, not at importlib
    assert {w.filename for w in caught if str(w.message) == message(old)} == {__file__}


@pytest.mark.parametrize("old", OLD_PACKAGES)
def test_an_old_package_forwards_to_the_new_one(old: str, monkeypatch: pytest.MonkeyPatch) -> None:
    new = importlib.import_module(MOVED[old])
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(DeprecationWarning, match=re.escape(message(old))):
        package = importlib.import_module(old)
    # a package of its own (`from old import module` looks modules up by its name) ...
    assert package.__name__ == old and package is not new
    # ... whose old modules are the new modules, each through its own row
    children = [o for o in MOVED if o.rpartition(".")[0] == old]
    assert children
    for child in children:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            module = getattr(package, child.rpartition(".")[2])
        assert module is importlib.import_module(MOVED[child])
    # ... and whose other names are the new package's
    for name in getattr(new, "__all__", []):
        assert getattr(package, name) is getattr(new, name)
    # a name without a row is no module, not a second copy of a new one
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(f"{old}.never_was")
    assert not hasattr(new, "never_was")


def test_the_warning_says_where_the_module_went() -> None:
    assert message("sparktrain.launch.rounds") == (
        "sparktrain.launch.rounds moved to sparktrain.strategies.tree_aggregate.driver; "
        "import it from there (the old path goes in the next release)"
    )
    # the metrics module was split: its old name answers with the driver's half, and the
    # warning names the executor's half too
    assert "sparktrain.task.metrics_client" in message("sparktrain.metrics")
    # an old package that was split names where its modules went
    assert "sparktrain.data" in message("sparktrain.worker")


def test_from_imports_of_an_old_name_work(monkeypatch: pytest.MonkeyPatch) -> None:
    for old in ("sparktrain.worker", "sparktrain.worker.round_codec", "sparktrain.metrics"):
        monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(DeprecationWarning):
        from sparktrain.comm import Mesh
        from sparktrain.metrics import MetricsClient, MetricsServer
        from sparktrain.worker import round_codec
    from sparktrain.driver.services.metrics_server import MetricsServer as Server
    from sparktrain.strategies.tree_aggregate import codec
    from sparktrain.task.metrics_client import MetricsClient as Client
    from sparktrain.wire.mesh import Mesh as NewMesh

    assert round_codec is codec
    assert (MetricsClient, MetricsServer) == (Client, Server)
    assert Mesh is NewMesh  # an old package's re-exports are the new package's


def test_an_old_daemon_module_still_runs_with_dash_m() -> None:
    # Spark runs spark.python.daemon.module as `python -m NAME`; a spark-defaults.conf may
    # still name the old module. Without a JVM on stdin the daemon prints its port (4
    # bytes) and exits as soon as stdin closes, as pyspark's own does.
    def run(module: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            [sys.executable, "-m", module],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=120,
            check=False,
        )

    old, new = run("sparktrain.launch.daemon"), run(MOVED["sparktrain.launch.daemon"])
    assert b"No module named" not in old.stderr and b"Traceback" not in old.stderr, old.stderr
    assert old.returncode == new.returncode
    assert len(old.stdout) == len(new.stdout) == 4  # the port


def test_a_pickle_made_under_an_old_name_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    from sparktrain.strategies.tree_aggregate.task import Block

    made = pickle.dumps(Block(3, None, None), protocol=0)
    old = made.replace(b"sparktrain.strategies.tree_aggregate.task", b"sparktrain.worker.rounds")
    assert old != made
    monkeypatch.delitem(sys.modules, "sparktrain.worker.rounds", raising=False)
    with pytest.warns(DeprecationWarning, match="sparktrain.worker.rounds moved"):
        block = pickle.loads(old)
    assert type(block) is Block and block.index == 3


def test_the_table_is_sound() -> None:
    for old, new in MOVED.items():
        # the old file is gone (else the finder would hide a module that still exists)
        path = REPO.joinpath(*old.split("."))
        assert not path.with_suffix(".py").exists() and not path.is_dir(), old
        # one hop: a new name is a real module, never another old one
        assert new not in MOVED, new
        assert importlib.util.find_spec(new) is not None, new
    assert importlib.util.find_spec("sparktrain.launch.never_was") is None
    _moved.install()  # idempotent: sparktrain/__init__.py installed it already
    assert sum(isinstance(f, _moved._MovedFinder) for f in sys.meta_path) == 1


def _imported_names(tree: ast.AST, module: str, is_package: bool) -> list[tuple[str, int]]:
    """Every dotted name a module imports (statements at any depth, and literal
    ``importlib.import_module``/``__import__`` calls), with its line; ``from a import b``
    gives both ``a`` and ``a.b``."""
    out: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                up = package[: len(package) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            out.append((base, node.lineno))
            out += [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            arg = node.args[0]
            literal = isinstance(arg, ast.Constant) and isinstance(arg.value, str)
            if name in ("import_module", "__import__") and literal:
                out.append((arg.value, node.lineno))
    return out


def old_imports(root: Path) -> list[str]:
    """``path:line imports old`` for every import of an old name under ``root``."""
    found = []
    for top in SCANNED:
        for path in sorted((root / top).rglob("*.py")):
            if path.resolve() == THIS:
                continue
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            module = ".".join(parts[:-1] if is_package else parts)
            tree = ast.parse(path.read_text(), str(path))
            hits = set()
            for name, line in _imported_names(tree, module, is_package):
                # the most specific old name: sparktrain.worker.rounds, not sparktrain.worker
                olds = [o for o in MOVED if name == o or name.startswith(o + ".")]
                if olds:
                    hits.add((line, max(olds, key=len)))
            # `from old_package import old_module` names both: keep the module
            hits = {
                (line, old)
                for line, old in hits
                if not any(o.startswith(old + ".") for n, o in hits if n == line)
            }
            rel = path.relative_to(root)
            found += [f"{rel}:{line} imports {old}" for line, old in sorted(hits)]
    return found


def test_nothing_imports_an_old_name() -> None:
    found = old_imports(REPO)
    assert not found, "import these by their new names (sparktrain/_moved.py):\n  " + (
        "\n  ".join(found)
    )


def test_the_scan_sees_old_imports(tmp_path: Path) -> None:
    # the check above must be able to fail
    (tmp_path / "sparktrain" / "worker").mkdir(parents=True)
    (tmp_path / "sparktrain" / "worker" / "x.py").write_text(
        "from . import rounds\n"
        "from sparktrain.launch import rounds as r\n"
        "def f():\n"
        "    import sparktrain.metrics\n"
        "    return importlib.import_module('sparktrain.worker.flat')\n"
        "from sparktrain.worker.rounds import Block\n"
        "from sparktrain.strategies.tree_aggregate import task\n"
        "from sparktrain.comm import Mesh\n"
        "import sparktrain.wire\n"
    )
    assert old_imports(tmp_path) == [
        "sparktrain/worker/x.py:1 imports sparktrain.worker.rounds",
        "sparktrain/worker/x.py:2 imports sparktrain.launch.rounds",
        "sparktrain/worker/x.py:4 imports sparktrain.metrics",
        "sparktrain/worker/x.py:5 imports sparktrain.worker.flat",
        "sparktrain/worker/x.py:6 imports sparktrain.worker.rounds",
        "sparktrain/worker/x.py:8 imports sparktrain.comm",
    ]
