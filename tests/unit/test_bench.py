"""The allreduce benchmark's parameter-server rows: records, table and arguments."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.allreduce import (
    ALGOS,
    DEFAULT_ALGOS,
    add_arguments,
    ps_record,
    record,
    table,
)


def test_ps_record_compares_with_the_ring():
    row = ps_record(4, 1 << 20, 4, 0.01)
    ring = record("ring", 4, 1 << 20, 0.01)
    assert row["algo"] == "ps4" and row["shards"] == 4
    assert row["busbw"] == pytest.approx(ring["busbw"])  # the same formula
    assert row["algbw"] == pytest.approx((1 << 20) / 0.01 / 1e9)


def test_table_shows_ps_time_relative_to_ring():
    rows = [
        record("ring", 2, 1 << 20, 0.002),
        ps_record(2, 1 << 20, 1, 0.005),
        ps_record(2, 1 << 20, 4, 0.001),
        ps_record(4, 1 << 24, 1, 0.1),  # no ring at this size: no ratio
    ]
    text = table(rows)
    lines = text.splitlines()
    assert lines[0].endswith("| vs Gloo / ring |")
    assert "| 2 | 1M | ps1 | 5000 us |" in text and "2.50x ring time |" in text
    assert "0.50x ring time |" in text
    assert lines[-1].startswith("| 4 | 16M | ps1 |") and lines[-1].endswith("|  |")
    assert sum("ring time" in line for line in lines) == 2


def test_table_with_gloo_and_ring_only_is_unchanged():
    rows = [record("ring", 2, 4096, 0.0001), record("gloo", 2, 4096, 0.0002)]
    text = table(rows)
    assert text.splitlines()[0].endswith("| vs Gloo |")
    assert "ring time" not in text
    assert "2.00x busbw, 0.50x time" in text


def test_ps_is_an_algo_but_not_a_default():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([])
    assert "ps" in ALGOS and args.algos == list(DEFAULT_ALGOS) and args.shards == [1, 4]
    args = parser.parse_args(["--algos", "ring", "ps", "--shards", "2"])
    assert args.algos == ["ring", "ps"] and args.shards == [2]


def test_torch_is_a_bench_algo_and_compares_with_gloo():
    from benchmarks.allreduce import TORCH

    assert TORCH in ALGOS and TORCH not in DEFAULT_ALGOS
    rows = [record("torch", 2, 1 << 20, 0.002), record("gloo", 2, 1 << 20, 0.001)]
    assert "| 2 | 1M | torch | 2000 us | 0.524 | 0.50x busbw, 2.00x time |" in table(rows)
