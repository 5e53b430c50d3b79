"""``sparktrain bench``: from a checkout it runs the repository's ``benchmarks/`` suite
(importing only the benchmark asked for); from a wheel's install, with no checkout, it says
in one line what to do instead."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import cli as bench_cli
from sparktrain import cli
from sparktrain.errors import SparkTrainError

ROOT = Path(__file__).resolve().parents[2]
# `sparktrain ARGS` with the copy of the package in argv[1] (checked: not this checkout's)
PROBE = (
    "import sys, sparktrain; assert sparktrain.__file__.startswith(sys.argv[1]); "
    "from sparktrain.cli import main; sys.exit(main(sys.argv[2:]))"
)


def test_the_checkout_is_found_next_to_the_package_or_in_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert cli.benchmarks_root() == ROOT  # the tests import this checkout's sparktrain
    assert cli.benchmarks_root([tmp_path, ROOT]) == ROOT
    assert cli.benchmarks_root([tmp_path]) is None
    monkeypatch.chdir(ROOT)
    assert cli.benchmarks_root([tmp_path, Path.cwd()]) == ROOT


def test_from_a_checkout_bench_runs_the_suite(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PYTHONPATH", "")
    with pytest.raises(SystemExit) as exit_info:
        cli.run_benchmarks(["--help"], root=ROOT)
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "usage: sparktrain bench" in out
    assert all(name in out for name in bench_cli.BENCHES)


def test_from_a_wheel_bench_says_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # a wheel's install: no benchmarks/ next to the package, none in the current directory
    monkeypatch.setattr(cli, "checkout_candidates", lambda: [tmp_path])
    assert cli.main(["bench", "report", "--check"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "not part of the installed package" in err
    assert "./dev bench report --check" in err and "python -m benchmarks report --check" in err
    with pytest.raises(SparkTrainError, match="clone sparktrain's repository"):
        cli.run_benchmarks(["train"], root=tmp_path)


def test_a_wheel_install_outside_a_checkout_says_what_to_do(tmp_path: Path) -> None:
    """The same, end to end: a copy of the package alone (as a wheel installs it) imported
    from a folder without benchmarks/, run from another such folder."""
    site = tmp_path / "site"
    shutil.copytree(
        ROOT / "sparktrain", site / "sparktrain", ignore=shutil.ignore_patterns("__pycache__")
    )
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(site), "bench", "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PYTHONPATH": str(site)},
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("sparktrain: error: the benchmarks are not part of")
    assert "./dev bench --help" in done.stderr and "Traceback" not in done.stderr


def test_top_level_options_before_bench_are_passed_on() -> None:
    assert cli._bench_argv(["-v", "bench", "report", "--check"]) == ["-v", "report", "--check"]
    assert cli._bench_argv(["bench"]) == []
    assert cli._bench_argv(["train", "conf.toml", "--set", "x=1"]) is None
    assert cli._bench_argv(["--version", "bench"]) is None  # the top-level parser answers


def test_bench_imports_only_the_benchmark_asked_for() -> None:
    assert bench_cli.wanted_bench(["-v", "report", "--check"]) == "report"
    assert bench_cli.wanted_bench(["--help"]) is None
    parser = bench_cli.build_parser(bench="report")
    args = parser.parse_args(["report", "--check"])
    assert args.what == "report" and args.check


def test_every_benchmark_builds_its_arguments() -> None:
    parser = bench_cli.build_parser()  # default: all benchmarks
    for name in bench_cli.BENCHES:
        assert parser.parse_args([name]).what == name


def test_missing_bench_extra_names_it() -> None:
    exc = ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib")
    with pytest.raises(SparkTrainError, match=r"\.\[bench\]"):
        bench_cli._raise_if_extra_missing(exc)
    other = ModuleNotFoundError("No module named 'foo'", name="foo")
    bench_cli._raise_if_extra_missing(other)  # not an extra's module: left to propagate


def test_the_root_goes_first_on_the_path_the_benchmarks_children_inherit() -> None:
    env = {"PYTHONPATH": "/elsewhere"}
    bench_cli.export_root(env)
    assert env["PYTHONPATH"] == os.pathsep.join([str(ROOT), "/elsewhere"])
    bench_cli.export_root(env)  # once only
    assert env["PYTHONPATH"].count(str(ROOT)) == 1
