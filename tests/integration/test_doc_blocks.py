"""Every ```python block of README.md and docs/*.md runs, twice: as a user's script
(``__main__``) and in a Jupyter kernel.

The blocks of one page run in order, in one namespace, as a user pastes a page into one
script or notebook (in the kernel, ``%reset -f`` starts each page); the functions and
classes they define are ``__main__``'s, so Spark pickles them by value, as it does a
user's. Before each page a prelude gives what a
pyspark shell or notebook has and the README's first block makes: ``spark`` (local[2],
quiet) and the digits DataFrames ``train_df`` and ``test_df`` (``features``, ``label``).
Each block runs in a scratch directory and must neither raise nor print a traceback to
stderr.

Not run: docs/connect.md's block, which needs a Spark Connect server and the user's
Parquet data (the ``connect`` tests train through one).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.docs, pytest.mark.spark, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN = {"docs/connect.md": "needs a Spark Connect server and the user's Parquet data"}
# pages whose blocks run as scripts only, with the reason (none today)
NOT_RUN_IN_KERNEL: dict[str, str] = {}

PRELUDE = textwrap.dedent(
    """
    from sparktrain import datasets as _datasets
    from sparktrain.session import get_or_create_session as _session

    spark = _session("local[2]")
    spark.sparkContext.setLogLevel("ERROR")
    _split = _datasets.digits()
    train_df = _datasets.to_dataframe(spark, _split.x_train, _split.y_train, 2)
    test_df = _datasets.to_dataframe(spark, _split.x_test, _split.y_test, 2)
    """
)

# one process, the blocks in order, each page in a fresh module registered as __main__
RUNNER = textwrap.dedent(
    """
    import contextlib, io, json, sys, traceback, types

    blocks, prelude = json.load(open(sys.argv[1])), sys.argv[2]
    module, page, results = None, None, []
    for block in blocks:
        if block["page"] != page:
            page = block["page"]
            module = types.ModuleType("__main__")
            module.__dict__["__file__"] = page
            sys.modules["__main__"] = module
            exec(compile(prelude, "prelude", "exec"), module.__dict__)
        err, ok = io.StringIO(), True
        with contextlib.redirect_stderr(err):
            try:
                code = compile(block["code"], f"{page}:{block['line']}", "exec")
                exec(code, module.__dict__)
            except BaseException:
                traceback.print_exc()
                ok = False
        results.append({"where": block["where"], "ok": ok, "stderr": err.getvalue()})
        print(json.dumps(results[-1]), flush=True)
    """
)


def python_blocks() -> list[dict[str, Any]]:
    """Every ```python block: its page, first line and code."""
    found = []
    for page in PAGES:
        rel = page.relative_to(ROOT).as_posix()
        if rel in NOT_RUN:
            continue
        text = page.read_text()
        for match in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M):
            line = text[: match.start()].count("\n") + 2
            code = match.group(1)
            found.append({"page": rel, "line": line, "where": f"{rel}:{line}", "code": code})
    return found


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    env.setdefault("PYSPARK_PYTHON", sys.executable)
    env.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    env.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    return env


def test_every_page_has_its_blocks_found() -> None:
    """The pages with code hold Python blocks this test runs (a renamed fence would
    silently drop a page)."""
    pages = {b["page"] for b in python_blocks()}
    assert {"README.md", "docs/run.md", "docs/api.md", "docs/ml.md", "docs/torch.md"} <= pages


def test_blocks_run_as_a_script(tmp_path: Path) -> None:
    blocks = python_blocks()
    listing = tmp_path / "blocks.json"
    listing.write_text(json.dumps(blocks))
    runner = tmp_path / "run_blocks.py"
    runner.write_text(RUNNER)
    work = tmp_path / "work"
    work.mkdir()
    out = subprocess.run(
        [sys.executable, str(runner), str(listing), PRELUDE],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=1700,
        env=_env(),
    )
    results = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    failed = [r for r in results if not r["ok"] or "Traceback" in r["stderr"]]
    assert not failed, "\n\n".join(f"{r['where']}:\n{r['stderr'][-4000:]}" for r in failed)
    assert out.returncode == 0, out.stderr[-4000:]
    assert [r["where"] for r in results] == [b["where"] for b in blocks]


def test_blocks_run_in_a_jupyter_kernel(tmp_path: Path) -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    blocks = [b for b in python_blocks() if b["page"] not in NOT_RUN_IN_KERNEL]
    notebook = nbformat.v4.new_notebook()
    cells, page = [], None
    for b in blocks:
        if b["page"] != page:  # a page starts afresh, as a new notebook would
            page = b["page"]
            cells.append(nbformat.v4.new_code_cell("%reset -f\n" + PRELUDE))
        cells.append(nbformat.v4.new_code_cell(b["code"], metadata={"where": b["where"]}))
    notebook.cells = cells
    work = tmp_path / "work"
    work.mkdir()
    old = dict(os.environ)
    os.environ.update(_env())  # the kernel inherits this process's environment
    try:
        client = nbclient.NotebookClient(
            notebook,
            timeout=600,
            kernel_name="python3",
            resources={"metadata": {"path": str(work)}},
        )
        client.execute()
    finally:
        os.environ.clear()
        os.environ.update(old)
    problems = []
    for cell in notebook.cells:
        if "where" not in cell.metadata:
            continue
        for output in cell.get("outputs", []):
            text = output.get("text", "") if output.get("name") == "stderr" else ""
            if output.get("output_type") == "error" or "Traceback" in text:
                problems.append(f"{cell.metadata['where']}: {text or output}")
    assert not problems, "\n\n".join(problems)
