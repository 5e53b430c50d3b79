"""The package's import graph keeps its layers: no cycles, no pyspark on the executors, no
benchmarks or test helpers in the core; the benchmarks (``benchmarks/``, not installed)
have no cycles either and take from the tests only their cluster helpers; and test files
share helpers through a fixtures module, never by importing each other.

The check reads the source with :mod:`ast` and imports nothing, so it is fast and sees
imports that a run would only reach on some paths. What counts as an import:

- every ``import`` and ``from ... import`` statement, at module level and inside functions
  alike, and ``importlib.import_module``/``__import__`` calls whose argument is a string
  literal (or an f-string, by its constant dotted prefix: ``f"benchmarks.{name}"`` is an
  import of ``benchmarks``); imports under
  ``if TYPE_CHECKING:`` are not (they never run), the ``else:`` branch of such an ``if`` is;
- ``from pkg import name`` imports the submodule ``pkg.name`` when there is one, else ``pkg``
  (relative imports resolved against the importing module);
- ``import a.b.c`` imports ``a.b.c``, and also each parent package whose ``__init__.py``
  holds code beyond re-exports. Python runs every parent ``__init__`` first, but an
  ``__init__`` that only re-exports (docstring, imports, ``__all__``, ``__version__``,
  ``if TYPE_CHECKING:``) is a facade over its children: nothing in it can depend on a child
  half-imported, and counting it would make every facade a cycle with its own children. One
  with code (functions, classes, other statements) counts, because its code runs before the
  child's. Importing the facade itself (``from sparktrain.compress import build``) is an
  import of the ``__init__`` like any other.

:func:`check` is the whole rule book and takes the root of a source tree, so the tests
below run it on small synthetic trees too: the check must be able to fail.
"""

from __future__ import annotations

import ast
import itertools
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = "sparktrain"
SPARK = ("pyspark", "py4j")

# Code that runs in Spark's Python workers, which import it without pyspark's driver side:
# neither it nor anything it imports at module level may import pyspark (function-level
# imports in these modules count too: they run on the executors).
EXECUTOR_CODE = (
    "sparktrain.task",
    "sparktrain.data",
    "sparktrain.sparse",
    "sparktrain.wire",
    "sparktrain.compress",
    "sparktrain.result",
    "sparktrain.parallel.stage",
    "sparktrain.parallel.group",
    "sparktrain.parallel.partition",
    "sparktrain.parallel.schedule",
    # what both halves of a strategy folder share (its task half: TASK_HALF below)
    "sparktrain.strategies.tree_aggregate.codec",
    "sparktrain.strategies.tree_aggregate.flat",
    "sparktrain.strategies.ps.protocol",
    "sparktrain.strategies.ps.layout",
    "sparktrain.strategies.ps.bootstrap",
)
# Executors unpickle strategy objects, so these modules must import without pyspark; their
# driver halves may import it inside functions.
EXECUTOR_IMPORTED = ("sparktrain.strategies",)
# A strategy folder's modules say by their name which side they run on: ``driver``,
# ``driver_*``, ``server``, ``server_*`` (sparktrain/strategies/tree_aggregate/driver_round.py,
# sparktrain/strategies/ps/server_tables.py) run on the driver only, like
# sparktrain/driver/, and may import pyspark; ``task``, ``task_*``, ``client``,
# ``client_*`` (sparktrain/strategies/ps/client.py) run in the tasks and are executor code.
DRIVER_HALF = ("driver", "server")
TASK_HALF = ("task", "client")
# the benchmark suite and the tests: top-level packages of the checkout, not installed
BENCH = "benchmarks"
TESTS = "tests"
# the one core module allowed to import the benchmarks (`sparktrain bench` from a
# checkout), and only inside a function
BENCH_LOADER = "sparktrain.cli"
# what the benchmarks may import from the tests: the clusters they run on
CLUSTER_HELPERS = "tests.cluster"


@dataclass(frozen=True)
class Import:
    """One import statement (or call): ``source`` imports ``target`` at ``path:line``."""

    source: str
    target: str
    path: str
    line: int
    module_level: bool

    def where(self) -> str:
        level = "" if self.module_level else " (in a function)"
        return f"{self.path}:{self.line}{level}"


@dataclass
class Graph:
    """The package's modules and their run-time imports."""

    modules: dict[str, Path] = field(default_factory=dict)
    # imports of modules inside the package, after resolution
    internal: list[Import] = field(default_factory=list)
    # imports of anything else, ``target`` being the top-level name (e.g. ``pyspark``)
    external: list[Import] = field(default_factory=list)

    def edges_from(self, module: str, module_level_only: bool = False) -> list[Import]:
        return [
            i
            for i in self.internal
            if i.source == module and (i.module_level or not module_level_only)
        ]


def module_names(root: Path, package: str = PACKAGE) -> dict[str, Path]:
    """Every module of ``package`` under ``root``, by dotted name (a package by its own)."""
    out: dict[str, Path] = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _dynamic_target(call: ast.Call) -> str | None:
    """The module a literal ``importlib.import_module``/``__import__`` call imports."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if name not in ("import_module", "__import__") or not call.args:
        return None
    arg = call.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr) and arg.values:
        head = arg.values[0]
        if isinstance(head, ast.Constant) and isinstance(head.value, str) and "." in head.value:
            return head.value.rpartition(".")[0]
    return None


class _Collector(ast.NodeVisitor):
    """The raw imports of one module: (dotted target, names imported from it, line, level)."""

    def __init__(self, module: str, is_package: bool) -> None:
        self.module = module
        self.is_package = is_package
        self.depth = 0  # functions we are inside
        self.found: list[tuple[str, list[str], int, bool]] = []

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            for stmt in node.orelse:
                self.visit(stmt)
        else:
            self.generic_visit(node)

    def _function(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.found.append((alias.name, [], node.lineno, self.depth == 0))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            here = self.module.split(".")
            package = here if self.is_package else here[:-1]
            up = package[: len(package) - (node.level - 1)]
            base = ".".join(up + ([base] if base else []))
        names = [a.name for a in node.names if a.name != "*"]
        self.found.append((base, names, node.lineno, self.depth == 0))

    def visit_Call(self, node: ast.Call) -> None:
        target = _dynamic_target(node)
        if target:
            self.found.append((target, [], node.lineno, self.depth == 0))
        self.generic_visit(node)


_FACADE_NAMES = {"__all__", "__version__", "__doc__"}


def is_facade(tree: ast.Module) -> bool:
    """Whether an ``__init__`` only re-exports (see the module docstring)."""
    for i, stmt in enumerate(tree.body):
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            continue
        if i == 0 and isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            continue
        if isinstance(stmt, ast.If) and _is_type_checking(stmt.test) and not stmt.orelse:
            continue
        if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            if all(isinstance(t, ast.Name) and t.id in _FACADE_NAMES for t in targets):
                continue
        return False
    return True


def build_graph(root: Path, package: str = PACKAGE) -> Graph:
    """Parse every module of ``package`` under ``root`` and resolve its imports."""
    graph = Graph(modules=module_names(root, package))
    trees = {m: ast.parse(p.read_text(), str(p)) for m, p in graph.modules.items()}
    code_bearing = {
        m for m, p in graph.modules.items() if p.name == "__init__.py" and not is_facade(trees[m])
    }

    def with_parents(target: str) -> list[str]:
        parts = target.split(".")
        parents = [".".join(parts[:n]) for n in range(1, len(parts))]
        return [p for p in parents if p in code_bearing] + [target]

    for module, path in graph.modules.items():
        collector = _Collector(module, path.name == "__init__.py")
        collector.visit(trees[module])
        rel = str(path.relative_to(root))
        for base, names, line, module_level in collector.found:
            top = base.partition(".")[0]
            if top != package:
                graph.external.append(Import(module, top, rel, line, module_level))
                continue
            targets: list[str] = []
            plain = [n for n in names if f"{base}.{n}" not in graph.modules]
            targets += [f"{base}.{n}" for n in names if f"{base}.{n}" in graph.modules]
            if plain or not names:
                # the longest prefix that is a module: `import a.b.C` style typos aside,
                # a name imported from a module is that module
                prefix = base
                while prefix and prefix not in graph.modules:
                    prefix = prefix.rpartition(".")[0]
                if prefix:
                    targets.append(prefix)
            for target in targets:
                for t in with_parents(target):
                    if t != module:
                        graph.internal.append(Import(module, t, rel, line, module_level))
    return graph


def _sccs(nodes: list[str], succ: dict[str, list[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative), those with more than one node."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(succ.get(start, [])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        comp.append(top)
                        if top == node:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(succ.get(child, []))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return sorted(out)


def _shortest_path(
    succ: dict[str, list[str]], start: str, goal: str, inside: set[str]
) -> list[str]:
    prev: dict[str, str] = {}
    queue = deque([start])
    seen = {start}
    while queue:
        node = queue.popleft()
        if node == goal:
            path = [goal]
            while path[-1] != start:
                path.append(prev[path[-1]])
            return path[::-1]
        for nxt in succ.get(node, []):
            if nxt in inside and nxt not in seen:
                seen.add(nxt)
                prev[nxt] = node
                queue.append(nxt)
    raise AssertionError(f"{goal} unreachable from {start} inside its own component")


def find_cycles(graph: Graph) -> list[list[str]]:
    """Import cycles, each as ``[a, b, ..., a]``: for every import inside a strongly
    connected component, the shortest cycle through it, so that every import that must go
    for the component to fall apart appears in some listed cycle."""
    succ: dict[str, list[str]] = {}
    for imp in graph.internal:
        succ.setdefault(imp.source, [])
        if imp.target not in succ[imp.source]:
            succ[imp.source].append(imp.target)
    cycles: set[tuple[str, ...]] = set()
    for comp in _sccs(sorted(graph.modules), succ):
        inside = set(comp)
        for a in comp:
            for b in succ.get(a, []):
                if b in inside:
                    ring = [a, *_shortest_path(succ, b, a, inside)[:-1]]
                    turn = ring.index(min(ring))  # one spelling per cycle
                    cycles.add(tuple(ring[turn:] + ring[:turn]))
    return [[*c, c[0]] for c in sorted(cycles)]


def _under(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _half(module: str, stems: tuple[str, ...]) -> bool:
    """A strategy folder's module whose name says it is of this half (``stem`` or
    ``stem_*``, see :data:`DRIVER_HALF` and :data:`TASK_HALF`)."""
    package, _, name = module.rpartition(".")
    return _under(package, EXECUTOR_IMPORTED) and any(
        name == stem or name.startswith(stem + "_") for stem in stems
    )


def _spark_chain(graph: Graph, start: str, first_hop_module_level: bool) -> list[str]:
    """Why importing ``start`` (or running it, for function-level first hops) imports
    pyspark: the chain of imports, empty when it does not."""
    spark_at = {i.source: i for i in graph.external if i.target in SPARK and i.module_level}
    direct = [
        i
        for i in graph.external
        if i.source == start
        and i.target in SPARK
        and (i.module_level or not first_hop_module_level)
    ]
    if direct:
        return [f"{start} imports {direct[0].target} at {direct[0].where()}"]
    prev: dict[str, Import] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        if node in spark_at and node != start:
            chain = [f"{spark_at[node].source} imports pyspark at {spark_at[node].where()}"]
            while node != start:
                imp = prev[node]
                chain.append(f"{imp.source} imports {imp.target} at {imp.where()}")
                node = imp.source
            return chain[::-1]
        only_module_level = node != start or first_hop_module_level
        for imp in graph.edges_from(node, module_level_only=only_module_level):
            if imp.target not in prev and imp.target != start:
                prev[imp.target] = imp
                queue.append(imp.target)
    return []


def spark_violations(graph: Graph) -> list[str]:
    """Executor code that imports pyspark, directly or through what it imports."""
    out = []
    for module in sorted(graph.modules):
        if _under(module, EXECUTOR_CODE) or _half(module, TASK_HALF):
            chain = _spark_chain(graph, module, first_hop_module_level=False)
        elif _under(module, EXECUTOR_IMPORTED) and not _half(module, DRIVER_HALF):
            chain = _spark_chain(graph, module, first_hop_module_level=True)
        else:
            continue
        if chain:
            out.append(" -> ".join(chain))
    return out


def bench_violations(graph: Graph) -> list[str]:
    """Core modules that import the benchmarks or the tests (cli.py may import the
    benchmarks, inside a function)."""
    return [
        f"{i.source} imports {i.target} at {i.where()}"
        for i in graph.external
        if i.target in (BENCH, TESTS)
        and not (i.source == BENCH_LOADER and i.target == BENCH and not i.module_level)
    ]


def imports_of_the_tests(root: Path, package: str) -> list[tuple[str, str, str]]:
    """(importing module, imported ``tests...`` module, where) for every import of the test
    tree by ``package``'s modules."""
    out = []
    for module, path in module_names(root, package).items():
        collector = _Collector(module, path.name == "__init__.py")
        collector.visit(ast.parse(path.read_text(), str(path)))
        rel = str(path.relative_to(root))
        for base, names, line, _ in collector.found:
            if base.partition(".")[0] == TESTS:
                for target in [f"{base}.{n}" for n in names] or [base]:
                    out.append((module, target, f"{rel}:{line}"))
    return out


def imports_between_test_files(root: Path) -> list[str]:
    """Test modules that import another test module: shared helpers belong in a fixtures
    module (``tests/unit/fixtures.py``, ``tests/integration/fixtures.py``)."""
    out = []
    for path in sorted((root / "tests").rglob("test_*.py")):
        rel = str(path.relative_to(root))
        collector = _Collector(".".join(path.relative_to(root).with_suffix("").parts), False)
        collector.visit(ast.parse(path.read_text(), rel))
        for base, names, line, _ in collector.found:
            for target in [base, *(f"{base}.{n}" for n in names)]:
                if target.startswith("tests.") and target.rpartition(".")[2].startswith("test_"):
                    out.append(f"{rel}:{line} imports {target}")
    return out


@dataclass
class Report:
    cycles: list[list[str]]
    spark: list[str]
    bench: list[str]
    graph: Graph

    def explain_cycles(self) -> str:
        where = {(i.source, i.target): i.where() for i in self.graph.internal}
        lines = [f"{len(self.cycles)} import cycle(s); break each at one of its imports:"]
        for cycle in self.cycles:
            lines.append("  " + " -> ".join(cycle))
            for a, b in itertools.pairwise(cycle):
                lines.append(f"      {a} -> {b}  at {where[(a, b)]}")
        return "\n".join(lines)


def check(root: Path, package: str = PACKAGE) -> Report:
    """Every rule of this module, on the tree at ``root``."""
    graph = build_graph(root, package)
    return Report(find_cycles(graph), spark_violations(graph), bench_violations(graph), graph)


# --- the real tree ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def real() -> Report:
    return check(REPO)


def test_no_import_cycles(real: Report) -> None:
    assert not real.cycles, real.explain_cycles()


def test_executor_code_never_imports_pyspark(real: Report) -> None:
    assert not real.spark, "executor code imports pyspark:\n  " + "\n  ".join(real.spark)


def test_core_never_imports_the_benchmarks_or_the_tests(real: Report) -> None:
    assert not real.bench, "the core imports the checkout's benchmarks or tests:\n  " + (
        "\n  ".join(real.bench)
    )


def test_the_benchmarks_have_no_import_cycles() -> None:
    report = check(REPO, BENCH)
    assert {"benchmarks.cli", "benchmarks.train", "benchmarks.report"} <= set(report.graph.modules)
    assert not report.cycles, report.explain_cycles()


def test_the_benchmarks_take_only_the_cluster_helpers_from_the_tests() -> None:
    found = imports_of_the_tests(REPO, BENCH)
    assert any(target.startswith(CLUSTER_HELPERS + ".") for _, target, _ in found)
    wrong = [f"{m} imports {t} at {w}" for m, t, w in found if not _under(t, (CLUSTER_HELPERS,))]
    assert not wrong, "the benchmarks import test code:\n  " + "\n  ".join(wrong)


def test_the_cluster_helpers_import_neither_the_benchmarks_nor_other_tests() -> None:
    # they are what the tests run Spark clusters with: no benchmark may be needed for that
    graph = build_graph(REPO, TESTS)
    helpers = [m for m in graph.modules if _under(m, (CLUSTER_HELPERS,))]
    assert f"{CLUSTER_HELPERS}.standalone" in helpers
    wrong = [
        f"{i.source} imports {i.target} at {i.where()}"
        for i in graph.internal + graph.external
        if i.source in helpers
        and (i.target == BENCH or (i.target in graph.modules and i.target not in helpers))
    ]
    assert not wrong, "\n  ".join(wrong)


def test_test_files_never_import_each_other() -> None:
    found = imports_between_test_files(REPO)
    assert not found, "move what they share into a fixtures module:\n  " + "\n  ".join(found)


def test_the_check_sees_the_real_package(real: Report) -> None:
    # a wrong root or package name would make every other test here pass vacuously
    assert {"sparktrain.cli", "sparktrain.task.loop", "sparktrain.wire.ring"} <= set(
        real.graph.modules
    )
    assert any(i.target == "pyspark" for i in real.graph.external)
    assert any(i.source == BENCH_LOADER and i.target == BENCH for i in real.graph.external)
    # a moved module must take its rule along: every name the rules list is still there
    for name in (*EXECUTOR_CODE, *EXECUTOR_IMPORTED, BENCH_LOADER):
        assert name in real.graph.modules, f"{name} is gone: update the rules above"
    # the strategy folders' halves the naming rule sees
    task_halves = {m for m in real.graph.modules if _half(m, TASK_HALF)}
    assert {
        "sparktrain.strategies.tree_aggregate.task",
        "sparktrain.strategies.ps.client",
        "sparktrain.strategies.allreduce.task_torch",
    } <= task_halves
    assert "sparktrain.strategies.ps.server" in {
        m for m in real.graph.modules if _half(m, DRIVER_HALF)
    }


# --- the check itself, on synthetic trees -----------------------------------------------


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_a_cycle_through_a_function_level_import_is_caught(tmp_path: Path) -> None:
    root = write(
        tmp_path,
        {
            "sparktrain/__init__.py": "",
            "sparktrain/a.py": "from sparktrain.b import g\n",
            "sparktrain/b.py": "def g():\n    from sparktrain import a\n    return a\n",
        },
    )
    report = check(root)
    assert report.cycles == [["sparktrain.a", "sparktrain.b", "sparktrain.a"]]
    assert "sparktrain/b.py:2 (in a function)" in report.explain_cycles()


def test_a_type_checking_only_cycle_is_not_a_cycle(tmp_path: Path) -> None:
    root = write(
        tmp_path,
        {
            "sparktrain/__init__.py": "",
            "sparktrain/a.py": "from sparktrain.b import g\n",
            "sparktrain/b.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n"
                "    from sparktrain.a import A\n"
                "else:\n"
                "    import json\n"
            ),
        },
    )
    report = check(root)
    assert report.cycles == []
    assert [i.target for i in report.graph.external if i.source == "sparktrain.b"] == [
        "typing",
        "json",
    ]


def test_relative_and_submodule_imports_resolve(tmp_path: Path) -> None:
    root = write(
        tmp_path,
        {
            "sparktrain/__init__.py": "",
            "sparktrain/pkg/__init__.py": '"""facade"""\nfrom .x import X\n__all__ = ["X"]\n',
            "sparktrain/pkg/x.py": "from . import y\nX = 1\n",
            "sparktrain/pkg/y.py": "import sparktrain.pkg.z\n",
            "sparktrain/pkg/z.py": "from ..pkg import x\n",
        },
    )
    report = check(root)
    # the facade __init__ is not imported by its children, so only x -> y -> z -> x cycles
    assert report.cycles == [
        ["sparktrain.pkg.x", "sparktrain.pkg.y", "sparktrain.pkg.z", "sparktrain.pkg.x"]
    ]


def test_an_init_with_code_counts_as_imported_with_its_children(tmp_path: Path) -> None:
    root = write(
        tmp_path,
        {
            "sparktrain/__init__.py": "",
            "sparktrain/pkg/__init__.py": "from sparktrain.b import B\nREADY = B\n",
            "sparktrain/pkg/x.py": "",
            "sparktrain/b.py": "import sparktrain.pkg.x\nB = 1\n",
        },
    )
    assert check(root).cycles == [["sparktrain.b", "sparktrain.pkg", "sparktrain.b"]]


def test_pyspark_in_executor_code_is_caught(tmp_path: Path) -> None:
    root = write(
        tmp_path,
        {
            "sparktrain/__init__.py": "",
            "sparktrain/task/__init__.py": "",
            "sparktrain/task/loop.py": "def f():\n    from pyspark import TaskContext\n",
            "sparktrain/data/__init__.py": "",
            "sparktrain/data/rows.py": "from sparktrain.driver import spark_side\n",
            "sparktrain/driver/__init__.py": "",
            "sparktrain/driver/spark_side.py": "import pyspark.sql\n",
            "sparktrain/driver/lazy.py": "def f():\n    import pyspark\n",
            "sparktrain/task/ok.py": "from sparktrain.driver import lazy\n",
            "sparktrain/strategies/__init__.py": "",
            "sparktrain/strategies/ring.py": "def driver():\n    import pyspark\n",
            "sparktrain/strategies/bad.py": "from pyspark.sql import DataFrame\n",
        },
    )
    spark = check(root).spark
    assert len(spark) == 3, spark
    assert "sparktrain.data.rows imports sparktrain.driver.spark_side" in spark[0]
    assert spark[1].startswith("sparktrain.strategies.bad imports pyspark at")
    assert spark[2] == (
        "sparktrain.task.loop imports pyspark at sparktrain/task/loop.py:2 (in a function)"
    )


def test_a_strategy_folder_keeps_pyspark_in_its_driver_half(tmp_path: Path) -> None:
    folder = "sparktrain/strategies/tree_aggregate"
    root = write(
        tmp_path,
        {
            "sparktrain/__init__.py": "",
            "sparktrain/strategies/__init__.py": "",
            f"{folder}/__init__.py": '"""facade"""\nfrom .strategy import S\n',
            # the driver half may import pyspark, at module level too
            f"{folder}/driver.py": "import pyspark\nfrom . import task\n",
            f"{folder}/driver_round.py": "from pyspark import RDD\n",
            # the plug-in reaches it only inside a function
            f"{folder}/strategy.py": "def launch():\n    from .driver import run\nS = 1\n",
            # the task half never, not even in a function
            f"{folder}/task.py": "def f():\n    from pyspark import TaskContext\n",
            # nor what both halves share, through a driver module
            f"{folder}/codec.py": "from .driver_round import RDD\n",
            # server* and client* name the halves too (the parameter server's folder)
            "sparktrain/strategies/ps/__init__.py": "",
            "sparktrain/strategies/ps/server_stats.py": "import pyspark\n",
            "sparktrain/strategies/ps/client.py": "def f():\n    import pyspark\n",
            "sparktrain/strategies/ps/clients.py": "def f():\n    import pyspark\n",
        },
    )
    spark = check(root).spark
    assert len(spark) == 3, spark
    assert spark[0] == (
        "sparktrain.strategies.ps.client imports pyspark at "
        "sparktrain/strategies/ps/client.py:2 (in a function)"
    )
    assert spark[1].startswith(
        "sparktrain.strategies.tree_aggregate.codec imports "
        "sparktrain.strategies.tree_aggregate.driver_round at"
    )
    assert spark[2].startswith(
        "sparktrain.strategies.tree_aggregate.task imports pyspark at "
        f"{folder}/task.py:2 (in a function)"
    )


def test_bench_imports_from_the_core_are_caught(tmp_path: Path) -> None:
    root = write(
        tmp_path,
        {
            "sparktrain/__init__.py": "",
            "benchmarks/__init__.py": "",
            "benchmarks/train.py": "from sparktrain import cli\nfrom tests.unit import fixtures\n",
            "sparktrain/cli.py": (
                "import importlib\n"
                "def bench(name):\n"
                '    return importlib.import_module(f"benchmarks.{name}")\n'
            ),
            "sparktrain/costmodel.py": "from benchmarks.train import run\n",
            "sparktrain/session.py": "def f():\n    from tests.cluster import standalone\n",
        },
    )
    assert check(root).bench == [
        "sparktrain.costmodel imports benchmarks at sparktrain/costmodel.py:1",
        "sparktrain.session imports tests at sparktrain/session.py:2 (in a function)",
    ]
    assert imports_of_the_tests(root, BENCH) == [
        ("benchmarks.train", "tests.unit.fixtures", "benchmarks/train.py:2")
    ]


def test_a_test_file_importing_another_is_caught(tmp_path: Path) -> None:
    root = write(
        tmp_path,
        {
            "tests/unit/test_a.py": "from .fixtures import pair\nfrom .test_b import _helper\n",
            "tests/unit/test_c.py": "def f():\n    from tests.unit import test_a\n",
        },
    )
    assert imports_between_test_files(root) == [
        "tests/unit/test_a.py:2 imports tests.unit.test_b",
        "tests/unit/test_c.py:2 imports tests.unit.test_a",
    ]
