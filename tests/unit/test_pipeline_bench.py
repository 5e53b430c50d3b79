"""The pipeline benchmark runs end to end on a tiny model (no timing assertions)."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks.pipeline import add_arguments, main

pytestmark = pytest.mark.timeout(120)


def test_bench_writes_json_and_markdown(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        [
            "--stages",
            "2",
            "--micro-batches",
            "4",
            "--batch-size",
            "32",
            "--width",
            "8",
            "--hidden",
            "16",
            "--depth",
            "3",
            "--steps",
            "3",
            "--json",
            str(tmp_path / "p.json"),
            "--markdown",
            str(tmp_path / "p.md"),
        ]
    )
    assert main(args) == 0
    records = json.loads((tmp_path / "p.json").read_text())
    by = {r["schedule"]: r for r in records}
    assert set(by) == {"gpipe", "1f1b"}
    assert by["gpipe"]["peak_in_flight"] == 4 and by["1f1b"]["peak_in_flight"] == 2
    assert by["1f1b"]["peak_activation_mib"] < by["gpipe"]["peak_activation_mib"]
    assert "| 2 | 4 | 1f1b |" in (tmp_path / "p.md").read_text()
