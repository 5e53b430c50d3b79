"""Partitions bigger than the worker's budget: spill files, memory-mapped rows, prefetch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest

from sparktrain.config import TrainConfig
from sparktrain.data import prefetch
from sparktrain.data.features import Features
from sparktrain.data.partition_data import FEATURES, LABEL, WEIGHT, SpillPlan, from_arrow
from sparktrain.data.prefetch import Prefetcher
from sparktrain.data.spill import SPILL_DIR_NAME, local_root, spill_path, sweep_orphans
from sparktrain.errors import ConfigError, DataError
from sparktrain.result import data_summary
from sparktrain.task.memory import anon_rss_bytes, peak_anon_bytes, reset_peak_anon

from .fixtures import loop_spec, spec_with, state_bytes, train_in_threads

WIDTH = 4


def _batches(rows: int, per_batch: int, seed: int = 0, weighted: bool = False):
    rng = np.random.default_rng(seed)
    out = []
    for start in range(0, rows, per_batch):
        n = min(per_batch, rows - start)
        x = rng.standard_normal((n, WIDTH)).astype(np.float32)
        cols = {
            FEATURES: pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), WIDTH),
            LABEL: pa.array(rng.integers(0, 3, n).astype(np.float64)),
        }
        if weighted:
            cols[WEIGHT] = pa.array(rng.random(n) + 0.5)
        out.append(pa.RecordBatch.from_pydict(cols))
    return out


def _plan(tmp_path, budget_bytes: int, rank: int = 0) -> SpillPlan:
    return SpillPlan(budget_bytes, spill_path("job-1", rank, 0, root=tmp_path))


def test_rows_past_the_budget_spill_and_read_back_the_same(tmp_path):
    batches = _batches(1000, 64, weighted=True)
    in_ram = from_arrow(batches, WIDTH, 0)
    spilled = from_arrow(batches, WIDTH, 0, _plan(tmp_path, budget_bytes=5_000))
    try:
        assert in_ram.path == "memory" and in_ram.spilled_bytes == 0
        assert spilled.path == "spilled" and spilled.spilled_bytes > 1000 * WIDTH * 4
        files = list((tmp_path / SPILL_DIR_NAME / "job-1").iterdir())
        assert [f.name for f in files] == [f"rank0-attempt0-pid{os.getpid()}.arrow"]
        # the map holds every row, also those held in memory before the budget ran out
        assert spilled.features.nbytes_in_memory == 0
        np.testing.assert_array_equal(spilled.x, in_ram.x)
        np.testing.assert_array_equal(spilled.y, in_ram.y)
        assert spilled.w is not None and in_ram.w is not None
        np.testing.assert_array_equal(spilled.w, in_ram.w)
        idx = np.random.default_rng(1).permutation(1000)[:200]
        assert spilled.gather(idx).numpy().tobytes() == in_ram.gather(idx).numpy().tobytes()
        # a held-out split is a view of the same map, not a copy
        train, val = spilled.split(0.25, seed=0, rank=0)
        ref_train, ref_val = in_ram.split(0.25, seed=0, rank=0)
        assert train.path == "spilled" and train.size == ref_train.size
        np.testing.assert_array_equal(val.gather(np.arange(val.size)), ref_val.x)
        np.testing.assert_array_equal(train.gather([3, 0, 7]), ref_train.x[[3, 0, 7]])
    finally:
        spilled.close()
    assert not (tmp_path / SPILL_DIR_NAME / "job-1").exists()
    spilled.close()  # twice is fine


def test_a_partition_within_the_budget_stays_in_memory_without_a_file(tmp_path):
    data = from_arrow(_batches(100, 30), WIDTH, 0, _plan(tmp_path, budget_bytes=1 << 20))
    assert data.path == "memory" and len(data.features.chunks) == 1  # one block, not 4 batches
    assert not (tmp_path / SPILL_DIR_NAME).exists()


def test_a_budget_of_zero_spills_every_row(tmp_path):
    data = from_arrow(_batches(10, 10), WIDTH, 0, _plan(tmp_path, budget_bytes=0))
    assert data.path == "spilled"
    data.close()


def test_bad_rows_after_the_spill_began_fail_and_leave_no_file(tmp_path):
    batches = _batches(300, 50)
    x = np.full((5, WIDTH), np.nan, np.float32)
    batches.append(
        pa.RecordBatch.from_pydict(
            {
                FEATURES: pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), WIDTH),
                LABEL: pa.array(np.zeros(5)),
            }
        )
    )
    with pytest.raises(DataError, match="rank 0: 5 rows have NaN or infinite features"):
        from_arrow(batches, WIDTH, 0, _plan(tmp_path, budget_bytes=1000))
    assert list((tmp_path / SPILL_DIR_NAME / "job-1").iterdir()) == []

    def failing():  # Spark's input stream breaking mid-partition
        yield from _batches(300, 50)
        raise OSError("connection to the JVM lost")

    with pytest.raises(OSError, match="JVM lost"):
        from_arrow(failing(), WIDTH, 0, _plan(tmp_path, budget_bytes=1000))
    assert list((tmp_path / SPILL_DIR_NAME / "job-1").iterdir()) == []


def test_orphans_of_dead_workers_are_swept_and_live_ones_kept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    dead_pid = int(dead.stdout)
    old_job = tmp_path / SPILL_DIR_NAME / "killed-job"
    old_job.mkdir(parents=True)
    (old_job / f"rank0-attempt0-pid{dead_pid}.arrow").write_bytes(b"x")
    (old_job / f"rank1-attempt0-pid{dead_pid}.arrow.part").write_bytes(b"x")
    live = tmp_path / SPILL_DIR_NAME / "live-job"
    live.mkdir()
    mine = live / f"rank0-attempt0-pid{os.getpid()}.arrow"
    mine.write_bytes(b"x")
    (live / "notes.txt").write_text("not ours")  # foreign names are never touched
    removed = sweep_orphans(tmp_path)
    assert sorted(p.name for p in removed) == [
        f"rank0-attempt0-pid{dead_pid}.arrow",
        f"rank1-attempt0-pid{dead_pid}.arrow.part",
    ]
    assert not old_job.exists() and mine.exists() and (live / "notes.txt").exists()
    assert sweep_orphans(tmp_path / "nowhere") == []


def test_features_take_across_chunks_in_the_order_asked():
    rng = np.random.default_rng(3)
    whole = rng.standard_normal((57, 3)).astype(np.float32)
    feats = Features([whole[:10], whole[10:10], whole[10:40], whole[40:]], 3)
    idx = rng.permutation(57)
    np.testing.assert_array_equal(feats.take(idx), whole[idx])
    sub = feats.subset(np.arange(57) % 3 == 0)
    np.testing.assert_array_equal(sub.array(), whole[::3])
    np.testing.assert_array_equal(sub.subset(np.array([4, 1])).array(), whole[::3][[4, 1]])
    assert feats.take(np.array([], np.int64)).shape == (0, 3)


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_prefetch_yields_the_same_batches_in_order(depth):
    made = []

    def make(i):
        made.append(i)
        return i * 10

    with Prefetcher(make, range(2, 9), depth) as p:
        assert [p.next() for _ in range(7)] == [20, 30, 40, 50, 60, 70, 80]
        with pytest.raises(IndexError):
            p.next()
    assert made == list(range(2, 9))


def test_prefetch_holds_at_most_depth_batches_and_stops_early():
    made = []

    def make(i):
        made.append(i)
        return i

    p = Prefetcher(make, range(1000), depth=2)
    deadline = time.monotonic() + 5
    while len(made) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    assert len(made) <= 3  # two in the queue, one waiting to be put
    assert p.next() == 0
    p.close()  # an epoch cut short: the thread ends, nothing hangs
    assert p._thread is not None and not p._thread.is_alive()


def test_prefetch_raises_a_failed_batch_where_it_would_have_been_returned():
    def make(i):
        if i == 2:
            raise DataError("bad batch")
        return i

    for depth in (0, 2):
        p = Prefetcher(make, range(5), depth)
        assert [p.next(), p.next()] == [0, 1]
        with pytest.raises(DataError, match="bad batch"):
            p.next()
        p.close()


class _PrefetchClock:
    """The prefetcher's clock (:mod:`time` in data/prefetch.py): it moves only when a
    batch is made (``make_s`` each); ``reading`` is set once ``next`` first reads it."""

    def __init__(self, make_s: float) -> None:
        self.now = 100.0
        self.make_s = make_s
        self.reading = threading.Event()

    def perf_counter(self) -> float:
        now = self.now  # read before telling: a batch made after does not move it
        self.reading.set()
        return now

    def make(self, i: int) -> int:
        self.now += self.make_s
        return i


def test_prefetch_counts_the_time_spent_making_batches_in_the_caller(monkeypatch):
    clock = _PrefetchClock(make_s=0.05)
    monkeypatch.setattr(prefetch, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    p = Prefetcher(clock.make, range(3), depth=0)  # depth 0: next() makes each batch
    assert [p.next() for _ in range(3)] == [0, 1, 2]
    p.close()
    assert p.wait_s == pytest.approx(3 * 0.05)


def test_prefetch_counts_the_time_waited_for_a_batch_not_ready(monkeypatch):
    clock = _PrefetchClock(make_s=0.05)
    monkeypatch.setattr(prefetch, "time", SimpleNamespace(perf_counter=clock.perf_counter))

    def make(i: int) -> int:
        if i == 0:  # the first batch is made while next() waits for it
            clock.reading.wait()
            return clock.make(i)
        return i  # the others take no time

    p = Prefetcher(make, range(3), depth=1)
    assert [p.next() for _ in range(3)] == [0, 1, 2]
    p.close()
    assert p.wait_s == pytest.approx(0.05)  # the wait for the first, and nothing else


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["ring", "tree"])
def test_spilled_and_in_memory_partitions_train_to_bitwise_equal_weights(tmp_path, strategy):
    spec = loop_spec(strategy=strategy, batch_size=16, shuffle=True, epochs=2,
                     validation_fraction=0.2)  # fmt: skip

    def parts(plan_budget: int | None):
        return [
            from_arrow(
                _batches(150 + 30 * r, 40, seed=r),
                WIDTH,
                r,
                None if plan_budget is None else _plan(tmp_path, plan_budget, rank=r),
            )
            for r in range(2)
        ]

    in_ram = train_in_threads(spec, parts(None))
    spilled_parts = parts(2_000)
    assert [p.path for p in spilled_parts] == ["spilled", "spilled"]
    spilled = train_in_threads(spec_with(spec, config=spec.config.replace(prefetch_batches=0)),
                               spilled_parts)  # fmt: skip
    for p in spilled_parts:
        p.close()
    assert state_bytes(spilled) == state_bytes(in_ram)
    stats = [json.loads(r.data) for out in spilled for r in out if r.kind == "stats"]
    summary = data_summary(stats)
    assert summary["data_path"] == "spilled" and summary["data_spilled_bytes"] > 0
    assert all(b > 0 for b in summary["peak_anon_bytes_per_worker"])
    ram_stats = [json.loads(r.data) for out in in_ram for r in out if r.kind == "stats"]
    assert data_summary(ram_stats)["data_path"] == "memory"


def test_the_budget_and_prefetch_depth_are_checked():
    assert TrainConfig().data_memory_mb == 512 and TrainConfig().prefetch_batches == 2
    TrainConfig(data_memory_mb=0).validate()
    for bad in (-1, float("nan"), "512", True):
        with pytest.raises(ConfigError, match="data_memory_mb"):
            TrainConfig(data_memory_mb=bad).validate()
    with pytest.raises(ConfigError, match="prefetch_batches"):
        TrainConfig(prefetch_batches=-1).validate()


def test_a_spilling_worker_s_memory_does_not_grow_with_its_partition(tmp_path):
    """Arrow IPC batches (what Spark sends) arrive as one buffer per message: keeping a
    view of any column (the labels) would keep every batch's features alive too."""
    rows, width = 200_000, 64  # 51 MB of features, 4 MiB of budget
    stream = tmp_path / "partition.arrows"
    schema = pa.schema([(FEATURES, pa.list_(pa.float32())), (LABEL, pa.float64())])
    rng = np.random.default_rng(0)
    with pa.OSFile(str(stream), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for _ in range(0, rows, 10_000):
            x = rng.random((10_000, width), dtype=np.float32).reshape(-1)
            offsets = pa.array(np.arange(0, x.size + 1, width, dtype=np.int32))
            lists = pa.ListArray.from_arrays(offsets, pa.array(x))
            writer.write_batch(pa.RecordBatch.from_arrays([lists, pa.array(np.zeros(10_000))],
                                                          schema=schema))  # fmt: skip

    def batches():
        with pa.OSFile(str(stream), "rb") as source:
            yield from pa.ipc.open_stream(source)

    reset_peak_anon()
    before = anon_rss_bytes()
    data = from_arrow(batches(), width, 0, _plan(tmp_path, budget_bytes=4 << 20))
    grown = peak_anon_bytes() - before
    data.close()
    assert data.path == "spilled"
    assert grown < 25 << 20, f"anonymous memory grew by {grown >> 20} MiB for a 4 MiB budget"


def test_spill_folders_sit_beside_the_executors_block_manager_folders(monkeypatch, tmp_path):
    app = tmp_path / "spark-app"
    monkeypatch.setenv("SPARK_LOCAL_DIRS", f"{app}/blockmgr-1234,{tmp_path}/other")
    assert local_root() == app  # shared by every executor of the application on the host
    monkeypatch.setenv("SPARK_LOCAL_DIRS", f"{tmp_path}/yarn-dir")
    assert local_root() == tmp_path / "yarn-dir"
    monkeypatch.delenv("SPARK_LOCAL_DIRS")
    assert local_root() == Path(tempfile.gettempdir())
