"""Compressed sparse rows: delta-coded ids, values through the job's compressor, a sparse
error-feedback residual, and its checkpoint (sparktrain/sparse/row_codec.py)."""

from __future__ import annotations

import io
import struct
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from sparktrain.checkpoint import CheckpointStore
from sparktrain.data.partition_data import PartitionData
from sparktrain.errors import ConfigError, FrameError, PeerLostError
from sparktrain.sparse.exchange import SparseRowExchange
from sparktrain.sparse.row_codec import (
    RESIDUAL_IDS,
    RESIDUAL_ROWS,
    RESIDUAL_SLOT,
    RowCompression,
    decode_ids,
    encode_ids,
    pack_tables,
    row_specs,
    unpack_tables,
)
from sparktrain.task.faults import FaultPlan, InjectedFaultError
from sparktrain.wire.ring import RingAllreduce

from .fixtures import loop_spec, run_mesh_ranks, spec_with, train_and_assemble, train_in_threads

pytestmark = pytest.mark.timeout(120)


# ---------------------------------------------------------------------- row ids
@pytest.mark.parametrize(
    ("ids", "num_rows", "width"),
    [
        ([], 10, 0),
        ([0], 1, 0),
        ([9], 10, 0),
        ([0, 9], 10, 1),
        ([0, 1, 2, 255, 510], 511, 1),
        ([0, 256, 300], 301, 2),
        ([3, 300, 70_000], 70_001, 4),
        ([0, 1 << 40], (1 << 40) + 1, 8),
        ([0, 1 << 62, (1 << 63) - 2], (1 << 63) - 1, 8),
    ],
)
def test_ids_round_trip_in_the_narrowest_width(ids: list[int], num_rows: int, width: int) -> None:
    blob = encode_ids(torch.tensor(ids, dtype=torch.int64))
    assert blob[0] == width
    assert blob.size == 16 + width * max(0, len(ids) - 1)
    got = decode_ids(blob, num_rows)
    assert got.dtype == torch.int64 and got.tolist() == ids


def test_zipf_ids_take_about_a_byte_each() -> None:
    rng = np.random.default_rng(0)
    ids = np.unique(np.minimum(rng.zipf(1.2, 4096) - 1, 999_999))
    blob = encode_ids(ids)
    assert torch.equal(decode_ids(blob, 1_000_000), torch.from_numpy(ids))
    assert blob.size < 8 * ids.size  # the width is per message: the largest gap decides


def _ids_blob(width: int, k: int, first: int, diffs: list[int]) -> np.ndarray:
    head = struct.pack("<BxxxIq", width, k, first)
    dt = {1: "<u1", 2: "<u2", 4: "<u4", 8: "<u8"}.get(width, "<u1")
    return np.frombuffer(head + np.array(diffs, dtype=dt).tobytes(), dtype=np.uint8).copy()


@pytest.mark.parametrize(
    ("blob", "num_rows"),
    [
        (np.zeros(5, np.uint8), 10),  # no header
        (_ids_blob(3, 3, 0, [1, 1]), 10),  # no such width
        (_ids_blob(1, 3, 0, [1]), 10),  # count says 3, holds 2
        (_ids_blob(1, 3, 0, [1, 1, 1]), 10),  # a byte too many
        (_ids_blob(1, 3, 0, [1, 0]), 10),  # not strictly increasing
        (_ids_blob(0, 1, 10, []), 10),  # first id past the table
        (_ids_blob(0, 1, -1, []), 10),  # negative
        (_ids_blob(1, 3, 5, [3, 2]), 10),  # last id past the table
        (_ids_blob(1, 11, 0, [1] * 10), 10),  # more ids than rows
        (_ids_blob(0, 0, 4, []), 10),  # an empty list with a first id
        (_ids_blob(8, 3, 1, [(1 << 63) - 2, (1 << 63) - 2]), (1 << 63) - 1),  # past 2**63
        (np.zeros(16, np.int8), 10),  # not bytes
    ],
)
def test_malformed_ids_are_rejected(blob: np.ndarray, num_rows: int) -> None:
    with pytest.raises(FrameError, match="malformed compressed payload"):
        decode_ids(blob, num_rows)


def test_the_encoder_refuses_unsorted_or_negative_ids() -> None:
    with pytest.raises(ValueError, match="strictly increasing"):
        encode_ids(torch.tensor([3, 3]))
    with pytest.raises(ValueError, match="negative"):
        encode_ids(torch.tensor([-1, 3]))


def test_malformed_messages_are_rejected() -> None:
    codec = RowCompression("int8+ef", 0, seed=1, stream=0)
    part = codec.encode(torch.tensor([1, 4]), torch.ones(2, 3), 1.0)
    blob = pack_tables(2.0, [part])
    count, parts = unpack_tables(blob, 1)
    assert count == 2.0
    ids, rows = codec.decode(parts[0], 10, 3, torch.float32)
    assert ids.tolist() == [1, 4] and torch.allclose(rows, torch.ones(2, 3), atol=0.01)
    for bad_blob, tables in [(blob[:-1], 1), (np.concatenate([blob, blob[:8]]), 1), (blob, 2)]:
        with pytest.raises(FrameError, match="malformed"):
            unpack_tables(bad_blob, tables)
    with pytest.raises(FrameError, match="malformed"):  # ids of 2 rows, values of 3 dims
        codec.decode(parts[0], 10, 4, torch.float32)
    with pytest.raises(FrameError, match="malformed"):  # an id outside a 3-row table
        codec.decode(parts[0], 3, 3, torch.float32)
    corrupt = parts[0].copy()
    corrupt[16] = 99  # the ids' width byte
    with pytest.raises(FrameError, match="malformed"):
        codec.decode(corrupt, 10, 3, torch.float32)


def test_momentum_is_refused_on_rows() -> None:
    with pytest.raises(ConfigError, match="sparse=True table"):
        RowCompression("topk:0.1+ef:momentum=0.9", 0, seed=0, stream=0)


def test_a_job_wide_spec_gives_the_rows_plain_error_feedback() -> None:
    """DGC's options are for dense buckets: a single job-wide spec keeps training sparse
    tables (their rows take plain ``+ef``, same reset); a table naming them is refused."""
    names = ["emb.weight", "user.weight"]
    assert row_specs("topk:0.01+ef:momentum=0.9", names) == ["topk:0.01+ef"] * 2
    assert (
        row_specs("topk:0.01+ef:reset=50,momentum=0.9,local_clip=2", names)
        == ["topk:0.01+ef:reset=50"] * 2
    )
    assert row_specs("int8+ef", names) == ["int8+ef"] * 2
    assert row_specs("none", names) == ["none"] * 2
    table = {"emb.*": "topk:0.01+ef:momentum=0.9", "*": "fp16"}
    assert row_specs(table, names) == ["topk:0.01+ef:momentum=0.9", "fp16"]
    for spec in row_specs("sign:chunk=32+ef:momentum=0.9", names):
        RowCompression(spec, 0, seed=0, stream=0)  # accepted


def test_a_checkpoint_from_before_row_compression_resumes_fresh() -> None:
    """Shards written when the rows went raw hold no row state: nothing was carried, so
    the row compressors start from zero instead of refusing the resume."""
    (first,) = _exchange_steps(1, "int8+ef", range(2), saved=[{}])
    assert first[0]  # the steps ran


# ---------------------------------------------------------------------- the exchange
ROWS, DIM = 400, 16


def _local(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s gradient rows at ``step``: Zipf ids (ranks share the hot rows)."""
    rng = np.random.default_rng(1000 * step + rank)
    ids = np.unique(np.minimum(rng.zipf(1.3, 40) - 1, ROWS - 1))
    rows = rng.standard_normal((ids.size, DIM)).astype(np.float32)
    return torch.from_numpy(ids), torch.from_numpy(rows)


def _exchange_steps(
    world: int,
    spec: str,
    steps: range,
    *,
    dense_at: tuple[int, ...] = (),
    saved: list[Any] | None = None,
) -> list[Any]:
    """Per rank: each step's averaged gradient (dense), the weight, the exchange and
    its state at the end (through torch.save/torch.load as a checkpoint shard would be).
    ``saved``: each rank's state to start from."""

    def body(rank: int, mesh: Any) -> Any:
        table = nn.Parameter(torch.zeros(ROWS, DIM))
        ring = RingAllreduce(mesh, chunk_bytes=4096)
        ex = SparseRowExchange([("emb.weight", table)], ring, ring, mesh, 0.5, [spec], seed=3)
        if saved is not None:
            ex.load_state_dict(saved[rank])
        weight = 3.0 + rank  # this rank's samples per step
        got = []
        for step in steps:
            ids, rows = _local(rank, step)
            table.grad = torch.sparse_coo_tensor(
                ids.unsqueeze(0), rows, (ROWS, DIM), check_invariants=True
            )
            ex.density = 0.0 if step in dense_at else 100.0
            total = ex.exchange(weight)
            got.append(table.grad.to_dense() * total)
        buf = io.BytesIO()
        torch.save(ex.state_dict(), buf)
        buf.seek(0)
        state = torch.load(buf, weights_only=True)
        return got, weight, ex, state

    out = run_mesh_ranks(world, body, join_timeout=60.0)
    for r in out:
        if isinstance(r, BaseException):
            raise r
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_int8_ef_rows_agree_on_every_rank_and_lose_nothing(world: int) -> None:
    steps = range(6)
    out = _exchange_steps(world, "int8:chunk=64+ef", steps, dense_at=(3,))
    for s in range(len(steps)):  # identical bits on all ranks
        for r in range(1, world):
            assert torch.equal(out[r][0][s], out[0][0][s])
    delivered = sum(out[0][0])
    inputs = torch.zeros(ROWS, DIM)
    left = torch.zeros(ROWS, DIM)
    for r in range(world):
        _, weight, ex, _ = out[r]
        touched: set[int] = set()
        for s in steps:
            ids, rows = _local(r, s)
            inputs[ids] += weight * rows
            touched.update(ids.tolist())
        res = ex.codecs[0].residual()
        assert res is not None
        r_ids, r_rows = res
        # sparse: only rows this rank touched, never a table-sized tensor
        assert set(r_ids.tolist()) <= touched and r_rows.shape == (r_ids.numel(), DIM)
        assert r_ids.numel() < ROWS // 2
        assert bool((r_ids[1:] > r_ids[:-1]).all())
        left[r_ids] += weight * r_rows
    # error feedback: what arrived is what went in less what is still carried
    torch.testing.assert_close(delivered, inputs - left, rtol=0, atol=2e-4)
    assert float(left.abs().max()) > 0  # compression did leave something out
    stats = out[0][2].stats()
    assert stats["sparse_dense_way"] == 1 and stats["sparse_row_way"] == len(steps) - 1
    ratio = stats["sparse_plain_message_bytes"] / stats["sparse_message_bytes"]
    assert ratio > 2.5, ratio  # int8 values and byte-wide id gaps vs int64 + float32


def test_uncompressed_rows_are_the_exact_sums() -> None:
    out = _exchange_steps(2, "none", range(3))
    for s in range(3):
        want = torch.zeros(ROWS, DIM)
        for r in range(2):
            ids, rows = _local(r, s)
            want[ids] += out[r][1] * rows
        torch.testing.assert_close(out[0][0][s], want, rtol=1e-6, atol=1e-6)
        assert torch.equal(out[1][0][s], out[0][0][s])
    assert out[0][3] == {}  # nothing to checkpoint


def test_checkpointed_row_state_resumes_bitwise() -> None:
    spec = "int8:chunk=64,stochastic+ef"
    unbroken = _exchange_steps(2, spec, range(6))
    first = _exchange_steps(2, spec, range(3))
    states = [first[r][3] for r in range(2)]
    assert set(states[0]) == {"emb.weight"}
    slots = states[0]["emb.weight"]["state"]["slots"]
    assert {RESIDUAL_IDS, RESIDUAL_SLOT, RESIDUAL_ROWS} <= set(slots)
    resumed = _exchange_steps(2, spec, range(3, 6), saved=states)
    for r in range(2):
        for s in range(3):
            assert torch.equal(resumed[r][0][s], unbroken[r][0][s + 3])
        a, b = resumed[r][2].codecs[0].residual(), unbroken[r][2].codecs[0].residual()
        assert a is not None and b is not None
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_a_state_of_another_spec_is_refused() -> None:
    codec = RowCompression("int8+ef", 0, seed=0, stream=0)
    other = RowCompression("fp16+ef", 0, seed=0, stream=0)
    with pytest.raises(ConfigError, match="same compression"):
        other.load_state_dict(codec.state_dict())


# ---------------------------------------------------------------------- the loop
TABLE, WIDTH, IDS = 60, 8, 4


class RowNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(5)  # the same weights on every thread
        self.emb = nn.Embedding(TABLE, WIDTH, sparse=True)
        self.head = nn.Linear(IDS * WIDTH, 3)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(x.long()).reshape(len(x), -1))


def _parts(sizes: list[int]) -> list[PartitionData]:
    rng = np.random.default_rng(4)
    return [
        PartitionData(
            np.minimum(rng.zipf(1.3, (n, IDS)) - 1, TABLE - 1).astype(np.float32),
            rng.integers(0, 3, n).astype(np.float64),
            np.zeros(n, bool),
        )
        for n in sizes
    ]


def _spec(**cfg: Any) -> Any:
    common = {"epochs": 4, "batch_size": 4, "lr": 0.1, "num_workers": 2, "sparse_density": 9.0}
    return spec_with(loop_spec(**{**common, **cfg}), model_fn=RowNet, feature_width=IDS)


def test_the_loop_compresses_rows_by_policy_and_resumes_exactly(tmp_path: Any) -> None:
    parts = _parts([12, 9])
    policy = {"emb.*": "int8:chunk=32+ef", "*": "none"}
    unbroken = train_and_assemble(_spec(compression=policy, checkpoint_every=1.0), parts)
    s = unbroken.summary
    assert s["sparse_compression"] == {"emb.weight": "int8:chunk=32+ef"}
    assert s["sparse_rows_ratio"] > 1.5
    plain = train_and_assemble(_spec(), parts)
    assert plain.summary["sparse_rows_ratio"] > 1.0  # the ids alone are delta-coded
    assert plain.summary["sparse_bytes_sent"] > s["sparse_bytes_sent"]
    diff = (unbroken.model.emb.weight - plain.model.emb.weight).detach().abs().max()
    assert 0 < float(diff) < 0.05  # compressed, and close to the exact rows

    spec = _spec(compression=policy, checkpoint_every=1.0, checkpoint_dir=str(tmp_path))
    plan = FaultPlan(rank=1, step=7, marker=str(tmp_path / "fault"))
    with pytest.raises((InjectedFaultError, PeerLostError)):
        train_in_threads(spec_with(spec, fault=plan), parts)
    step = CheckpointStore(str(tmp_path)).latest_step()
    assert step is not None and 0 < step < 7
    resumed = train_and_assemble(spec_with(spec, fault=plan, attempt=1, resume_step=step), parts)
    for a, b in zip(resumed.model.parameters(), unbroken.model.parameters(), strict=True):
        assert torch.equal(a, b)
    shard = CheckpointStore(str(tmp_path)).load_shard(step, 1, 2)
    assert shard is not None and set(shard["sparse_rows"]) == {"emb.weight"}
