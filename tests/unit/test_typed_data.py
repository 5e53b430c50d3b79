"""Typed model inputs on the worker, without Spark: Arrow batches as the launcher sends
them (one column per input, named by its ``wire``), ingested column by column into memory
or spill files, gathered into batches, and trained on by ranks in threads."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

import sparktrain.data.partition_data as worker_data
from sparktrain.data.batch import Batch, Collator
from sparktrain.data.columns import Column, Layout
from sparktrain.data.partition_data import (
    IS_VALIDATION,
    LABEL,
    WEIGHT,
    PartitionData,
    SpillPlan,
    from_arrow,
)
from sparktrain.data.spill import SPILL_DIR_NAME, spill_path, sweep_orphans
from sparktrain.errors import DataError
from sparktrain.result import assemble

from .fixtures import loop_spec, spec_with, state_bytes, train_in_threads
from .typed_hooks import typed_net

BIG = 2**53  # ids past float64's exact integers
JOB = "typed-job"


def _layout(label_width: int | None = None) -> Layout:
    """An int64 id, a float32 (2, 3) block, ragged int64 tokens, bytes decoded to (2, 2)."""
    return Layout(
        (
            Column("ids", "user_id", "features_0", "dense", "int64"),
            Column("x", "x", "features_1", "dense", "float32", (2, 3)),
            Column("tokens", "tokens", "features_2", "ragged", "int64", (-1,)),
            Column(
                "image",
                "png",
                "features_3",
                "binary",
                "binary",
                (),
                "tests.unit.typed_hooks:decode_pixels",
            ),
        ),
        "keyword",
        label_width,
        ("label",) if label_width is None else tuple(f"y{i}" for i in range(label_width)),
    )


def _record_batch(
    n: int,
    rng: np.random.Generator,
    *,
    weighted: bool = False,
    validation: float = 0.0,
    label_width: int | None = None,
    classes: int = 3,
) -> pa.RecordBatch:
    """``n`` rows as the launcher ships them: Spark's ``bigint``, ``array<float>``,
    ``array<bigint>`` and ``binary`` columns, a double label (``array<double>`` for k
    labels), the validation flag, and optionally the weight."""
    lengths = rng.integers(0, 6, n)
    tokens = [rng.integers(0, 10, k).tolist() for k in lengths]
    cols: dict[str, pa.Array] = {
        "features_0": pa.array(BIG + rng.integers(-(2**40), 2**40, n), pa.int64()),
        "features_1": pa.array(
            list(rng.standard_normal((n, 6)).astype(np.float32)), pa.list_(pa.float32())
        ),
        "features_2": pa.array(tokens, pa.list_(pa.int64())),
        "features_3": pa.array(
            [bytes(row) for row in rng.integers(0, 256, (n, 4), dtype=np.uint8)], pa.binary()
        ),
    }
    if label_width is None:
        cols[LABEL] = pa.array(rng.integers(0, classes, n).astype(np.float64))
    else:
        cols[LABEL] = pa.array(
            list(rng.integers(0, 2, (n, label_width)).astype(np.float64)), pa.list_(pa.float64())
        )
    cols[IS_VALIDATION] = pa.array(rng.random(n) < validation)
    if weighted:
        cols[WEIGHT] = pa.array(rng.random(n) + 0.5)
    return pa.RecordBatch.from_pydict(cols)


def _stream(sizes: list[int], seed: int = 0, **kw: object) -> list[pa.RecordBatch]:
    rng = np.random.default_rng(seed)
    return [_record_batch(n, rng, **kw) for n in sizes]  # type: ignore[arg-type]


def _plan(tmp_path: Path, budget: int, rank: int = 0) -> SpillPlan:
    return SpillPlan(budget, spill_path(JOB, rank, 0, root=tmp_path))


def _files(tmp_path: Path) -> list[str]:
    folder = tmp_path / SPILL_DIR_NAME / JOB
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def _same_batches(a: Batch, b: Batch) -> None:
    """Bitwise: every input, mask, label and weight, dtype and shape included."""
    assert list(a.inputs) == list(b.inputs) and list(a.masks) == list(b.masks)
    pairs = [(a.inputs[k], b.inputs[k]) for k in a.inputs]
    pairs += [(a.masks[k], b.masks[k]) for k in a.masks]
    pairs += [(a.labels, b.labels), (a.weights, b.weights)]
    for x, y in pairs:
        if x is None or y is None:
            assert x is None and y is None
            continue
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.numpy().tobytes() == y.numpy().tobytes()


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dense columns in blocks of a few rows: gathers cross many blocks (and, spilled,
    many record batches of the file)."""
    monkeypatch.setattr(worker_data, "MIN_BLOCK_BYTES", 64)
    monkeypatch.setattr(worker_data, "BLOCK_BYTES", 64)


# ---------------------------------------------------------------------- ingest and spill
def test_spilled_and_in_memory_partitions_give_identical_batches(tmp_path, small_blocks):
    layout = _layout()
    batches = _stream([7, 0, 13, 1, 29, 10], weighted=True)
    in_ram = from_arrow(batches, layout, 0, None)
    spilled = from_arrow(batches, layout, 0, _plan(tmp_path, budget=0))
    pid = os.getpid()
    try:
        assert in_ram.path == "memory" and in_ram.spilled_bytes == 0
        assert spilled.path == "spilled" and spilled.spilled_bytes > 0
        assert all(c.spilled and c.nbytes_in_memory == 0 for c in spilled.columns)
        assert len(spilled.columns[1].chunks) > 5  # x's 60 rows in blocks of 2
        # one spill file per column while the partition is open
        assert _files(tmp_path) == sorted(
            [f"rank0-attempt0-pid{pid}.arrow"]
            + [f"rank0-attempt0-pid{pid}-c{i}.arrow" for i in (1, 2, 3)]
        )
        assert spilled.size == in_ram.size == 60
        collator = Collator(layout)
        order = np.random.default_rng(1).permutation(60)
        for idx in (order[:17], order[17:], np.array([59, 0, 0, 30]), np.array([], np.int64)):
            _same_batches(spilled.batch(idx, collator, 0), in_ram.batch(idx, collator, 0))
        whole = in_ram.batch(np.arange(60), collator, 0)
        # int64 ids past 2**53 arrive exactly as sent
        sent = np.concatenate([b.column("features_0").to_numpy() for b in batches])
        assert whole.inputs["ids"].dtype == torch.int64
        assert whole.inputs["ids"].numpy().tolist() == sent.tolist()
        assert whole.inputs["x"].shape == (60, 2, 3) and whole.inputs["image"].shape == (60, 2, 2)
        lengths = [len(v) for b in batches for v in b.column("features_2").to_pylist()]
        assert whole.masks["tokens"].sum(1).tolist() == lengths
        assert whole.inputs["tokens"].shape == (60, max(lengths))
        # the train/validation views read the same maps
        for view, ref in zip(spilled.split(0.3, 0, 0), in_ram.split(0.3, 0, 0), strict=True):
            assert view.path == "spilled" and view.size == ref.size
            idx = np.arange(view.size)[::-1].copy()
            _same_batches(view.batch(idx, collator, 0), ref.batch(idx, collator, 0))
    finally:
        spilled.close()
    assert _files(tmp_path) == []
    spilled.close()  # twice is fine


def _large_types(batch: pa.RecordBatch) -> pa.RecordBatch:
    """The batch as Spark sends it with ``spark.sql.execution.arrow.useLargeVarTypes``."""
    large = {
        "features_1": pa.large_list(pa.float32()),
        "features_2": pa.large_list(pa.int64()),
        "features_3": pa.large_binary(),
    }
    return pa.RecordBatch.from_pydict(
        {n: batch.column(n).cast(large.get(n, batch.column(n).type)) for n in batch.schema.names}
    )


@pytest.mark.parametrize("spill", [False, True])
def test_large_list_and_binary_types_give_the_same_batches(tmp_path, spill):
    layout = _layout()
    batches = _stream([9, 4], seed=4)
    ref = from_arrow(batches, layout, 0)
    data = from_arrow(
        [_large_types(b) for b in batches], layout, 0, _plan(tmp_path, 0) if spill else None
    )
    try:
        assert data.path == ("spilled" if spill else "memory")
        idx = np.array([12, 0, 5, 9, 3])
        collator = Collator(layout)
        _same_batches(data.batch(idx, collator, 0), ref.batch(idx, collator, 0))
    finally:
        data.close()


def test_a_partition_within_the_budget_keeps_every_column_in_memory(tmp_path):
    data = from_arrow(_stream([5, 5]), _layout(), 0, _plan(tmp_path, budget=1 << 20))
    assert data.path == "memory" and not (tmp_path / SPILL_DIR_NAME).exists()
    assert [c.spilled for c in data.columns] == [False] * 4


def test_spilling_starts_past_the_budget_and_keeps_earlier_rows(tmp_path, small_blocks):
    batches = _stream([10] * 8, seed=2)
    in_ram = from_arrow(batches, _layout(), 0)
    spilled = from_arrow(batches, _layout(), 0, _plan(tmp_path, budget=600))
    try:
        assert spilled.path == "spilled"
        collator = Collator(_layout())
        _same_batches(
            spilled.batch(np.arange(80), collator, 0), in_ram.batch(np.arange(80), collator, 0)
        )
    finally:
        spilled.close()


def test_a_collate_writing_to_its_rows_changes_neither_store(tmp_path):
    layout = Layout(
        (
            Column(
                "tokens",
                "tokens",
                "features_0",
                "ragged",
                "int64",
                (-1,),
                None,
                "tests.unit.typed_hooks:collate_shift",
            ),
        ),
        "keyword",
    )
    batch = pa.RecordBatch.from_pydict(
        {"features_0": pa.array([[1, 2], [3], []], pa.list_(pa.int64())), LABEL: [0.0, 1.0, 0.0]}
    )
    in_ram = from_arrow([batch], layout, 0)
    spilled = from_arrow([batch], layout, 0, _plan(tmp_path, budget=0))
    collator = Collator(layout)
    try:
        for data in (in_ram, spilled, in_ram):  # spilled: a read-only map
            got = data.batch(np.arange(3), collator, 0)
            assert got.inputs["tokens"].tolist() == [[2, 3], [4, 0], [0, 0]]
            assert got.masks["tokens"].tolist() == [[True, True], [True, False], [False, False]]
    finally:
        spilled.close()


def _with_bad_rows(make_bad: Callable[[], pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    yield from _stream([20, 20, 20], seed=3)
    yield make_bad()


def _replace(batch: pa.RecordBatch, name: str, column: pa.Array) -> pa.RecordBatch:
    cols = {n: batch.column(n) for n in batch.schema.names}
    cols[name] = column
    return pa.RecordBatch.from_pydict(cols)


def _bad(name: str, column: pa.Array) -> Callable[[], pa.RecordBatch]:
    return lambda: _replace(_stream([2], seed=9)[0], name, column)


F32 = pa.list_(pa.float32())
BAD_ROWS = {
    "nan in x": (
        _bad("features_1", pa.array([[0.0] * 6, [0.0] * 5 + [np.nan]], F32)),
        r"column 'x', partition 0: 1 rows .* hold NaN or infinite values",
    ),
    "short x row": (
        _bad("features_1", pa.array([[0.0] * 6, [0.0] * 5], F32)),
        r"column 'x', partition 0: a row has 5 values, the first row had 6; its feature_shapes "
        r"entry \[2, 3\]",
    ),
    "null id": (
        _bad("features_0", pa.array([1, None], pa.int64())),
        r"column 'user_id', partition 0: 1 rows are null; drop them",
    ),
    "null x": (
        _bad("features_1", pa.array([None, [0.0] * 6], F32)),
        r"column 'x', partition 0: 1 rows are null",
    ),
    "null x element": (
        _bad("features_1", pa.array([[0.0] * 6, [0.0] * 5 + [None]], F32)),
        r"column 'x', partition 0: arrays hold null elements",
    ),
    "null tokens": (
        _bad("features_2", pa.array([[1], None], pa.list_(pa.int64()))),
        r"column 'tokens', partition 0: 1 rows are null",
    ),
    "null token": (
        _bad("features_2", pa.array([[1], [2, None]], pa.list_(pa.int64()))),
        r"column 'tokens', partition 0: arrays hold null elements",
    ),
    "null bytes": (
        _bad("features_3", pa.array([None, b"abcd"], pa.binary())),
        r"column 'png', partition 0: 1 rows are null",
    ),
    "null label": (
        _bad(LABEL, pa.array([None, 1.0], pa.float64())),
        r"rank 0: 1 rows have a null label",
    ),
}


@pytest.mark.parametrize("case", list(BAD_ROWS))
def test_bad_rows_after_spilling_began_fail_by_column_and_leave_no_file(tmp_path, case):
    make_bad, needle = BAD_ROWS[case]
    with pytest.raises(DataError, match=needle):
        from_arrow(_with_bad_rows(make_bad), _layout(), 0, _plan(tmp_path, budget=1000))
    assert _files(tmp_path) == []
    # in memory: the same refusal
    with pytest.raises(DataError, match=needle):
        from_arrow(_with_bad_rows(make_bad), _layout(), 0)


def test_a_broken_stream_after_spilling_began_leaves_no_file(tmp_path):
    def broken() -> Iterator[pa.RecordBatch]:
        yield from _stream([30, 30])
        raise OSError("connection to the JVM lost")

    with pytest.raises(OSError, match="JVM lost"):
        from_arrow(broken(), _layout(), 0, _plan(tmp_path, budget=0))
    assert _files(tmp_path) == []


def test_a_row_of_another_width_suggests_a_variable_length_column():
    layout = Layout(
        (Column("emb", "embedding", "features_0", "dense", "float32", (3,)),), "keyword"
    )
    rows = pa.array([[1.0, 2.0, 3.0], [1.0, 2.0]], F32)
    with pytest.raises(
        DataError,
        match=r"column 'embedding', partition 4: a row has 2 values, the first row had 3; "
        r"declare it variable-length with feature_shapes=\{'emb': \[-1\]\}",
    ):
        from_arrow([pa.RecordBatch.from_pydict({"features_0": rows, LABEL: [0.0, 1.0]})], layout, 4)


def test_nan_in_a_ragged_float_column_names_it():
    layout = Layout((Column("seq", "seq", "features_0", "ragged", "float32", (-1,)),), "keyword")
    rows = pa.array([[1.0], [], [np.inf, 2.0]], F32)
    with pytest.raises(DataError, match=r"column 'seq', partition 2: 1 rows \(or batches"):
        from_arrow([pa.RecordBatch.from_pydict({"features_0": rows, LABEL: [0.0] * 3})], layout, 2)


def test_float16_columns_refuse_values_past_their_range():
    layout = Layout((Column("h", "h", "features_0", "dense", "float16", (2,)),), "keyword")
    rows = pa.array([[1.0, 65504.0], [1.0, 1e5]], F32)  # float32 on the wire
    batch = pa.RecordBatch.from_pydict({"features_0": rows, LABEL: [0.0, 1.0]})
    with pytest.raises(DataError, match=r"column 'h', partition 0: 1 rows .* float16's range"):
        from_arrow([batch], layout, 0)
    fine = from_arrow([batch.slice(0, 1)], layout, 0)
    assert fine.columns[0].take(np.array([0])).tolist() == [[1.0, 65504.0]]


def test_a_null_element_outside_a_sliced_batch_is_not_this_batch_s():
    layout = Layout((Column("tok", "tok", "features_0", "ragged", "int64", (-1,)),), "keyword")
    whole = pa.RecordBatch.from_pydict(
        {
            "features_0": pa.array([[1, None], [2], [3, 4]], pa.list_(pa.int64())),
            LABEL: [0.0, 1.0, 2.0],
        }
    )
    data = from_arrow([whole.slice(1, 2)], layout, 0)
    assert [r.tolist() for r in data.columns[0].take(np.arange(2))] == [[2], [3, 4]]


@pytest.mark.parametrize("spill", [False, True])
def test_several_labels_a_row_round_trip(tmp_path, spill):
    layout = _layout(label_width=3)
    batches = _stream([4, 6], seed=5, label_width=3)
    data = from_arrow(batches, layout, 0, _plan(tmp_path, 0) if spill else None)
    try:
        sent = np.array([row for b in batches for row in b.column(LABEL).to_pylist()])
        assert data.y.shape == (10, 3) and data.y.dtype == np.float64
        np.testing.assert_array_equal(data.y, sent)
        batch = data.batch(np.array([9, 2]), Collator(layout), 0)
        assert batch.labels is not None and batch.labels.tolist() == sent[[9, 2]].tolist()
    finally:
        data.close()
    # no rows: still k labels a row
    assert from_arrow([], layout, 0).y.shape == (0, 3)
    bad = pa.RecordBatch.from_pydict(
        {
            **{n: batches[0].column(n) for n in batches[0].schema.names},
            LABEL: pa.array([[0.0, 1.0, 0.0]] * 3 + [[1.0, 1.0]], pa.list_(pa.float64())),
        }
    )
    with pytest.raises(DataError, match=r"label column 'y0, y1, y2'.*a row has 2 labels"):
        from_arrow([bad], layout, 0)


def test_orphaned_column_files_of_a_dead_worker_are_swept(tmp_path):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    folder = tmp_path / SPILL_DIR_NAME / "old-job"
    folder.mkdir(parents=True)
    names = [
        f"rank0-attempt0-pid{dead.stdout.strip()}{s}"
        for s in (".arrow", "-c1.arrow", "-c12.arrow.part")
    ]
    for name in [*names, "rank0-attempt0-pid1-cx.arrow"]:
        (folder / name).write_bytes(b"x")
    removed = sweep_orphans(tmp_path)
    assert sorted(p.name for p in removed) == sorted(names)
    assert [p.name for p in folder.iterdir()] == ["rank0-attempt0-pid1-cx.arrow"]


# ---------------------------------------------------------------------- training
@pytest.mark.timeout(120)
def test_typed_columns_train_to_the_same_weights_spilled_or_not(tmp_path, small_blocks):
    """Ring allreduce on two ranks of a model called ``model(ids=, x=, tokens=, image=,
    tokens_mask=)``: in memory with prefetch 2, spilled with prefetch 0."""
    layout = _layout()
    spec = spec_with(
        loop_spec(
            strategy="ring", batch_size=16, shuffle=True, epochs=2, validation_fraction=0.2, lr=0.1
        ),
        model_fn=typed_net,
        layout=layout,
    )

    def parts(budget: int | None) -> list[PartitionData]:
        return [
            from_arrow(
                _stream([40, 30 + 20 * r], seed=10 + r, weighted=True),
                layout,
                r,
                None if budget is None else _plan(tmp_path, budget, rank=r),
            )
            for r in range(2)
        ]

    in_ram = train_in_threads(
        spec_with(spec, config=spec.config.replace(prefetch_batches=2)), parts(None)
    )
    spilled_parts = parts(0)
    assert [p.path for p in spilled_parts] == ["spilled", "spilled"]
    try:
        spilled = train_in_threads(
            spec_with(spec, config=spec.config.replace(prefetch_batches=0)), spilled_parts
        )
    finally:
        for p in spilled_parts:
            p.close()
    assert state_bytes(spilled) == state_bytes(in_ram)
    # it did train: every parameter moved from its initial value, on both ranks alike
    records = [r for out in in_ram for r in out]
    torch.manual_seed(spec.config.seed)
    trained = assemble(typed_net(), records, spec.config, wall_s=1.0, stage_s=1.0)
    assert trained.summary["replicas_in_sync"]
    torch.manual_seed(spec.config.seed)
    initial = typed_net().state_dict()
    for name, value in trained.model.state_dict().items():
        assert not torch.equal(value, initial[name]), name
    assert [h["epoch"] for h in trained.history] == [0, 1]
