"""Sparse embedding gradients on the ring and the tree (docs/sparse.md): the row path
against the dense path (``sparse_embeddings="off"``) and single-process torch, per
optimizer, in float64, through the built-in loop in threads over real sockets."""

from __future__ import annotations

import functools
import json
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sparktrain.checkpoint import CheckpointStore
from sparktrain.data.partition_data import PartitionData
from sparktrain.errors import ConfigError, PeerLostError
from sparktrain.sparse.rows import decode_rows, encode_rows, sum_rows
from sparktrain.task.faults import FaultPlan, InjectedFaultError
from sparktrain.task.run_context import RunContext

from .fixtures import (
    loop_spec,
    rank0_value,
    run_in_threads,
    spec_with,
    train_and_assemble,
    train_in_threads,
)

pytestmark = pytest.mark.timeout(120)

ROWS, DIM, IDS = 40, 3, 4  # table rows, embedding width, ids per sample


class SparseNet(nn.Module):
    """``IDS`` ids per sample through a float64 embedding table (``sparse`` as given),
    then a dense head (or the summed embeddings as the 3 logits without one)."""

    def __init__(self, sparse: bool = True, head: bool = True, bag: bool = False) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(7)  # the same weights on every thread
        kind = nn.EmbeddingBag if bag else nn.Embedding
        extra = {"mode": "sum"} if bag else {}
        self.emb = kind(ROWS, DIM, sparse=sparse, dtype=torch.float64, **extra)
        self.bag = bag
        self.head = nn.Linear(DIM if bag else IDS * DIM, 3, dtype=torch.float64) if head else None
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = x.long()
        e = self.emb(ids)  # [B, DIM] (a bag per sample) or [B, IDS, DIM]
        if self.head is None:
            return e if self.bag else e.sum(1)
        return self.head(e if self.bag else e.reshape(len(x), -1))


def id_parts(sizes: list[int], seed: int = 0) -> list[PartitionData]:
    """Zipf-like ids (low ids on every rank, so ranks share rows), random labels."""
    rng = np.random.default_rng(seed)
    parts = []
    for n in sizes:
        ids = np.minimum(rng.zipf(1.3, (n, IDS)) - 1, ROWS - 1)
        parts.append(
            PartitionData(
                ids.astype(np.float32), rng.integers(0, 3, n).astype(np.float64), np.zeros(n, bool)
            )
        )
    return parts


ROW_WAY = {"sparse_density": 100.0}  # never switch to the dense way
DENSE_WAY = {"sparse_density": 0.0}  # always


def spec_for(model_fn: Any = SparseNet, **cfg: Any) -> Any:
    """The loop on a :class:`SparseNet`; the row way unless ``cfg`` says otherwise."""
    common = {"epochs": 3, "batch_size": 1000, "lr": 0.5, "num_workers": 2, **ROW_WAY, **cfg}
    return spec_with(loop_spec(**common), model_fn=model_fn, feature_width=IDS)


def reference(model: nn.Module, opt: torch.optim.Optimizer, parts: list[PartitionData], steps: int):
    """Full-batch training in one process on the union of the partitions."""
    x = torch.from_numpy(np.concatenate([p.x for p in parts]))
    y = torch.from_numpy(np.concatenate([p.y for p in parts])).long()
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model


def max_diff(a: nn.Module, b: nn.Module) -> float:
    return max(
        float((x.detach() - y.detach()).abs().max())
        for x, y in zip(a.parameters(), b.parameters(), strict=True)
    )


def summary_stats(outputs: Any) -> list[dict[str, Any]]:
    stats = [json.loads(r.data) for out in outputs for r in out if r.kind == "stats"]
    return sorted(stats, key=lambda s: s["rank"])


# ---------------------------------------------------------------------- the codec
def test_rows_round_trip_and_sum_duplicates():
    a = (torch.tensor([1, 5, 9]), torch.arange(9, dtype=torch.float64).view(3, 3))
    b = (torch.tensor([0, 5]), torch.ones(2, 3, dtype=torch.float64))
    empty = (torch.zeros(0, dtype=torch.int64), torch.zeros(0, 2, dtype=torch.float32))
    blob = encode_rows([a, empty], 3.0)
    count, got = decode_rows(blob, [(10, 3), (4, 2)], [torch.float64, torch.float32])
    assert count == 3.0
    assert torch.equal(got[0][0], a[0]) and torch.equal(got[0][1], a[1])
    assert got[1][0].numel() == 0 and got[1][1].shape == (0, 2)
    union, rows = sum_rows([a, b])
    assert union.tolist() == [0, 1, 5, 9]
    assert torch.equal(rows[2], a[1][1] + 1)
    with pytest.raises(ValueError, match="outside"):
        decode_rows(blob, [(5, 3), (4, 2)], [torch.float64, torch.float32])
    with pytest.raises(ValueError, match="does not hold"):
        decode_rows(blob[:-16], [(10, 3), (4, 2)], [torch.float64, torch.float32])


# ---------------------------------------------------------------------- optimizers
@pytest.mark.parametrize("strategy", ["ring", "tree"])
@pytest.mark.parametrize(
    "optimizer,kwargs,lr", [(torch.optim.SGD, {}, 0.5), (torch.optim.Adagrad, {}, 0.1)]
)
@pytest.mark.parametrize("sizes", [[13, 5], [11, 0, 7]])
@pytest.mark.parametrize("way", [ROW_WAY, DENSE_WAY])
def test_rows_equal_dense_and_single_process_torch(strategy, optimizer, kwargs, lr, sizes, way):
    """Duplicate ids within and across ranks, uneven partitions (one empty): the row
    path (either way of its switch), the dense path and torch in one process agree
    within 1e-6 in float64."""
    parts = id_parts(sizes)
    cfg = {"strategy": strategy, "optimizer": optimizer, "optimizer_kwargs": kwargs, "lr": lr}
    cfg.update(num_workers=len(sizes), **way)
    rows = train_and_assemble(spec_for(**cfg), parts)
    dense = train_and_assemble(spec_for(sparse_embeddings="off", **cfg), parts)
    model = SparseNet()
    want = reference(model, optimizer(model.parameters(), lr=lr, **kwargs), parts, 3)
    assert max_diff(rows.model, want) <= 1e-6
    assert max_diff(dense.model, want) <= 1e-6
    assert max_diff(rows.model, SparseNet()) > 1e-2  # it trained
    assert rows.summary["sparse_tables"] == 1
    assert rows.summary["sparse_rows_per_step"] > 0
    assert "sparse_tables" not in dense.summary
    taken = "sparse_row_way" if way is ROW_WAY else "sparse_dense_way"
    assert rows.summary[taken] == 3  # one exchange per epoch, all of them that way
    # the row exchanges are counted in the run's byte totals
    assert rows.summary["bytes_sent"] >= rows.summary["sparse_bytes_sent"] > 0
    assert rows.summary["wire_bytes"] >= rows.summary["sparse_wire_bytes"] > 0


def test_sparse_adam_matches_torch():
    parts = id_parts([13, 6])
    model_fn = functools.partial(SparseNet, head=False)
    got = train_and_assemble(spec_for(model_fn, optimizer=torch.optim.SparseAdam, lr=0.05), parts)
    model = model_fn()
    want = reference(model, torch.optim.SparseAdam(model.parameters(), lr=0.05), parts, 3)
    assert max_diff(got.model, want) <= 1e-6
    assert max_diff(got.model, model_fn()) > 1e-2


def lazy_sgd_reference(parts, lr, momentum, weight_decay, nesterov, steps):
    """docs/sparse.md's lazy momentum SGD, written out: only touched rows move."""
    model = SparseNet()
    x = torch.from_numpy(np.concatenate([p.x for p in parts]))
    y = torch.from_numpy(np.concatenate([p.y for p in parts])).long()
    dense = torch.optim.SGD(
        model.head.parameters(),
        lr=lr,
        momentum=momentum,
        weight_decay=weight_decay,
        nesterov=nesterov,
    )
    buf = torch.zeros_like(model.emb.weight)
    for _ in range(steps):
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        dense.step()
        g = model.emb.weight.grad.coalesce()
        idx, rows = g.indices()[0], g.values()
        with torch.no_grad():
            w = model.emb.weight
            rows = rows + weight_decay * w[idx]
            buf[idx] = momentum * buf[idx] + rows
            d = rows + momentum * buf[idx] if nesterov else buf[idx]
            w[idx] -= lr * d
    return model


@pytest.mark.parametrize("nesterov", [False, True])
def test_momentum_sgd_is_the_documented_lazy_variant(nesterov):
    parts = id_parts([13, 5])
    kwargs = {"momentum": 0.9, "weight_decay": 0.01, "nesterov": nesterov}
    got = train_and_assemble(
        spec_for(optimizer=torch.optim.SGD, optimizer_kwargs=kwargs, lr=0.1, epochs=4), parts
    )
    want = lazy_sgd_reference(parts, 0.1, 0.9, 0.01, nesterov, 4)
    assert max_diff(got.model, want) <= 1e-6
    # not torch's dense momentum: untouched rows do not move (the test can tell)
    eager = SparseNet(sparse=False)
    reference(eager, torch.optim.SGD(eager.parameters(), lr=0.1, **kwargs), parts, 4)
    assert max_diff(got.model, eager) > 1e-4


def test_dense_adam_on_a_sparse_table_steps_it_densely():
    """Adam takes dense gradients only: the averaged rows are scattered into one, so
    the numbers are single-process Adam on a sparse=False table (and the dense path's)."""
    parts = id_parts([13, 5])
    cfg = {"optimizer": "adam", "lr": 0.05}
    got = train_and_assemble(spec_for(**cfg), parts)
    off = train_and_assemble(spec_for(sparse_embeddings="off", **cfg), parts)
    model = SparseNet(sparse=False)
    want = reference(model, torch.optim.Adam(model.parameters(), lr=0.05), parts, 3)
    assert max_diff(got.model, want) <= 1e-6
    assert max_diff(off.model, want) <= 1e-6


@pytest.mark.parametrize(
    "optimizer,kwargs,model_fn,match",
    [
        (torch.optim.Adagrad, {"weight_decay": 0.1}, SparseNet, "weight_decay"),
        (torch.optim.SparseAdam, {}, SparseNet, "SparseAdam steps sparse"),
    ],
)
def test_undefined_combinations_are_refused(optimizer, kwargs, model_fn, match):
    spec = spec_for(model_fn, optimizer=optimizer, optimizer_kwargs=kwargs)
    with pytest.raises(ConfigError, match=match):
        train_in_threads(spec, id_parts([5, 5]))


@pytest.mark.parametrize(
    "cfg,match",
    [
        ({"shard_optimizer": True, "optimizer": "sgd"}, "shard_optimizer"),
        ({"sparse_density": -1.0}, "sparse_density"),
    ],
)
def test_unsupported_settings_are_refused(cfg, match):
    with pytest.raises(ConfigError, match=match):
        train_in_threads(spec_for(**cfg), id_parts([5, 5]))


# ---------------------------------------------------------------------- the switch
@pytest.mark.parametrize("strategy", ["ring", "tree"])
def test_density_switch_changes_the_wire_not_the_numbers(strategy):
    parts = id_parts([13, 9, 6])
    cfg = {"strategy": strategy, "num_workers": 3, "optimizer": torch.optim.Adagrad, "lr": 0.1}
    rows_out = train_in_threads(spec_for(sparse_density=100.0, **cfg), parts)
    dense_out = train_in_threads(spec_for(sparse_density=0.0, **cfg), parts)
    rows, dense = summary_stats(rows_out), summary_stats(dense_out)
    assert all(s["sparse_row_way"] == 3 and s["sparse_dense_way"] == 0 for s in rows)
    assert all(s["sparse_row_way"] == 0 and s["sparse_dense_way"] == 3 for s in dense)
    got_rows = train_and_assemble(spec_for(sparse_density=100.0, **cfg), parts).model
    got_dense = train_and_assemble(spec_for(sparse_density=0.0, **cfg), parts).model
    assert max_diff(got_rows, got_dense) <= 1e-12
    # on a table this small the touched rows are a fraction of the table: few bytes
    assert all(
        r["sparse_raw_bytes_sent"] < d["sparse_raw_bytes_sent"]
        for r, d in zip(rows, dense, strict=True)
    )


def test_the_switch_follows_the_touched_rows():
    """Small batches touch few rows (row way), the full batch many (dense way)."""
    parts = id_parts([40, 40])
    cfg = {"batch_size": 2, "epochs": 1, "sparse_density": 0.2, "lr": 0.05}
    stats = summary_stats(train_in_threads(spec_for(**cfg), parts))
    assert all(s["sparse_row_way"] > 0 for s in stats)
    full = summary_stats(train_in_threads(spec_for(**{**cfg, "batch_size": 1000}), parts))
    assert all(s["sparse_dense_way"] == 1 and s["sparse_row_way"] == 0 for s in full)


# ---------------------------------------------------------------------- the loop's features
@pytest.mark.parametrize(
    "extra",
    [
        {"accumulate_steps": 2, "batch_size": 4},
        {"accumulate_steps": 2, "batch_size": 4, **DENSE_WAY},
        {"clip_grad_norm": 0.05, "batch_size": 4},
        {"overlap": False, "batch_size": 4, "bucket_mb": 0.0001},
        {"precision": "bf16", "batch_size": 4},
        {"precision": "fp16", "batch_size": 4},  # the loss scaler unscales the rows too
    ],
)
def test_rows_equal_dense_with_the_loops_features(extra):
    parts = id_parts([8, 8])
    _rows_equal_dense(parts, extra)


@pytest.mark.parametrize("extra", [{}, DENSE_WAY])
def test_rows_equal_dense_accumulating_over_uneven_partitions(extra):
    # 3 micro-batches of 4 rows against 1: each rank's sum of means becomes one mean
    # before the exchange, for the rows as for the buckets
    parts = id_parts([12, 4])
    rows = _rows_equal_dense(parts, {"accumulate_steps": 3, "batch_size": 4, **extra})
    assert rows.summary["replicas_in_sync"]


def _rows_equal_dense(parts, extra):
    cfg = {"optimizer": torch.optim.Adagrad, "lr": 0.1, "epochs": 2, **extra}
    rows = train_and_assemble(spec_for(**cfg), parts)
    dense = train_and_assemble(spec_for(sparse_embeddings="off", **cfg), parts)
    assert max_diff(rows.model, dense.model) <= 1e-9
    if "clip_grad_norm" in extra:  # clipping did act
        unclipped = train_and_assemble(spec_for(**{**cfg, "clip_grad_norm": 0.0}), parts)
        assert max_diff(unclipped.model, rows.model) > 1e-3
    return rows


def test_compression_reaches_the_rows():
    """One spec compresses the dense head's buckets and the table's rows alike
    (sparktrain/sparse/row_codec.py; tests/unit/test_sparse_rows_compress.py)."""
    parts = id_parts([9, 4])
    cfg = {"compression": "int8", "lr": 0.1}
    got = train_and_assemble(spec_for(**cfg), parts)
    assert got.summary["sparse_tables"] == 1 and got.summary["sparse_bytes_sent"] > 0
    by_spec = got.summary["compression_by_spec"]
    assert set(by_spec) == {"int8"} and by_spec["int8"]["elements"] == IDS * DIM * 3 + 3
    assert got.summary["sparse_compression"] == {"emb.weight": "int8"}
    plain = train_and_assemble(spec_for(lr=0.1), parts)
    assert max_diff(got.model, plain.model) > 0  # compression did act on the head


def test_an_embedding_bag_and_a_model_of_tables_only():
    parts = id_parts([9, 4])
    for model_fn in (
        functools.partial(SparseNet, bag=True),
        functools.partial(SparseNet, head=False),
    ):
        rows = train_and_assemble(spec_for(model_fn, lr=0.1), parts)
        dense = train_and_assemble(spec_for(model_fn, sparse_embeddings="off", lr=0.1), parts)
        assert max_diff(rows.model, dense.model) <= 1e-9


def test_resume_from_a_checkpoint_continues_the_unbroken_run(tmp_path):
    """Adagrad's per-row sums, SparseAdam's moments and the lazy momentum buffer
    round-trip a checkpoint."""
    tables_only = functools.partial(SparseNet, head=False)
    for name, opt, kwargs, model_fn in [
        ("adagrad", torch.optim.Adagrad, {}, SparseNet),
        ("sparse_adam", torch.optim.SparseAdam, {}, tables_only),
        ("lazy", torch.optim.SGD, {"momentum": 0.9}, SparseNet),
    ]:
        cfg = {"epochs": 4, "optimizer": opt, "optimizer_kwargs": kwargs, "lr": 0.1}
        cfg["checkpoint_every"] = 1.0
        parts = id_parts([10, 7])
        unbroken = train_and_assemble(spec_for(model_fn, **cfg), parts)
        spec = spec_for(model_fn, checkpoint_dir=str(tmp_path / name), **cfg)
        plan = FaultPlan(rank=1, step=3, marker=str(tmp_path / f"fault-{name}"))
        with pytest.raises((InjectedFaultError, PeerLostError)):
            train_in_threads(spec_with(spec, fault=plan), parts)
        step = CheckpointStore(str(tmp_path / name)).latest_step()
        assert step is not None and 0 < step < 4
        resumed = train_and_assemble(
            spec_with(spec, fault=plan, attempt=1, resume_step=step), parts
        )
        assert max_diff(resumed.model, unbroken.model) <= 1e-12, name


# ---------------------------------------------------------------------- ctx.distributed
def _run_fn(ctx: RunContext) -> dict[str, Any]:
    model = SparseNet()
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1)
    model, optimizer = ctx.distributed(model, optimizer)
    for epoch in range(3):
        for batch in ctx.batches(epoch, uneven="idle"):
            if batch is not None:
                loss = F.cross_entropy(model(batch.x), batch.y.long())
                loss.backward()
            optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_ctx_distributed_takes_the_row_path():
    parts = id_parts([13, 5])
    spec = spec_for()
    value, _ = rank0_value(run_in_threads(spec, parts, _run_fn))
    model = SparseNet()
    want = reference(model, torch.optim.Adagrad(model.parameters(), lr=0.1), parts, 3)
    for k, v in want.state_dict().items():
        assert float((value[k] - v).abs().max()) <= 1e-6


@pytest.mark.parametrize(
    "name,cls", [("adagrad", torch.optim.Adagrad), ("sparse_adam", torch.optim.SparseAdam)]
)
def test_the_sparse_optimizers_have_config_names(name, cls):
    """A TOML config or an ml Param names them; the same numbers as passing the class."""
    parts = id_parts([8, 5])
    tables_only = functools.partial(SparseNet, head=False)
    named = train_and_assemble(spec_for(tables_only, optimizer=name, lr=0.1), parts)
    given = train_and_assemble(spec_for(tables_only, optimizer=cls, lr=0.1), parts)
    assert max_diff(named.model, given.model) == 0.0
