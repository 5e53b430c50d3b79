"""Sparse embedding rows through the parameter server (docs/sparse_ps.md): shards in this
process, ranks as threads, real sockets, no Spark."""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
import pytest
import torch
from torch import nn

from sparktrain.checkpoint import CheckpointStore
from sparktrain.config import TrainConfig
from sparktrain.data.partition_data import PartitionData
from sparktrain.errors import CommError, ConfigError
from sparktrain.result import TrainResult, assemble
from sparktrain.strategies.ps import protocol
from sparktrain.strategies.ps import server_persist as persist
from sparktrain.strategies.ps.layout import dense_ranges
from sparktrain.strategies.ps.server import ParameterServer, start_parameter_server

from .fixtures import HOST, SECRET, ps_clients, train_in_threads
from .sparse_ps_fixtures import build, cfg, parts, spec, torch_reference


def train(
    c: TrainConfig,
    data: list[PartitionData],
    *,
    rows: int = 40,
    dtype: torch.dtype = torch.float64,
    server: ParameterServer | None = None,
    resume_step: int | None = None,
) -> tuple[TrainResult, ParameterServer]:
    """Train with a server in this process; the driver's result (server.finish done)."""
    model_fn = functools.partial(build, rows, True, dtype)
    if server is None:
        server = start_parameter_server(
            model_fn(), c, host=HOST, secret=SECRET, job_id="job", attempt=0
        )
    s = dataclasses.replace(spec(c, tuple(server.addresses), model_fn), resume_step=resume_step)
    try:
        outputs = train_in_threads(s, data, timeout=90)
    finally:
        server.stop()
    records = [r for out in outputs for r in out]
    result = assemble(model_fn(), records, c, wall_s=1.0, stage_s=1.0)
    server.finish(result)
    return result, server


def params(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in m.named_parameters()}


def assert_same(got: nn.Module, want: nn.Module, tol: float) -> None:
    g, w = params(got), params(want)
    assert g.keys() == w.keys()
    for k in g:
        torch.testing.assert_close(g[k], w[k], rtol=tol, atol=tol, msg=k)


# ---------------------------------------------------------------------- training


@pytest.mark.timeout(120)
@pytest.mark.parametrize("optimizer", ["sgd", torch.optim.Adagrad], ids=["sgd", "adagrad"])
def test_sparse_ps_equals_dense_ps_and_single_process_torch(optimizer):
    data = parts([13, 6])  # uneven: rank 1 runs out of rows and joins with none
    sparse, server = train(cfg(optimizer=optimizer), data)
    dense, _ = train(cfg(optimizer=optimizer, sparse_embeddings="off"), data)
    assert_same(sparse.model, dense.model, 1e-6)
    assert_same(sparse.model, torch_reference(cfg(optimizer=optimizer), data), 1e-6)
    # micro-batches: the sparse gradients add up across them, then one mean
    acc_sparse, _ = train(cfg(optimizer=optimizer, accumulate_steps=2), data)
    acc_dense, _ = train(
        cfg(optimizer=optimizer, accumulate_steps=2, sparse_embeddings="off"), data
    )
    assert_same(acc_sparse.model, acc_dense.model, 1e-6)
    assert not torch.equal(acc_sparse.model.head.weight, sparse.model.head.weight)
    s = sparse.summary["ps"]
    assert s["rows_pushed"] > 0 and s["rows_pulled"] > 0 and s["row_pulls"] > 0
    assert dense.summary["ps"]["rows_pushed"] == 0
    assert sparse.summary["replicas_in_sync"]  # the dense head; the tables are caches
    # the tables moved (the comparison above is not vacuous)
    assert not torch.equal(sparse.model.items.weight, build().items.weight)
    # the driver's model holds the server's full tables
    np.testing.assert_array_equal(sparse.model.users.weight.detach().numpy(), server.table(0))


@pytest.mark.timeout(120)
def test_momentum_and_adam_are_lazy_untouched_rows_never_move():
    data = parts([10, 10])
    touched = {int(v) for p in data for v in p.x[:, :4].ravel()}
    untouched = sorted(set(range(40)) - touched)
    assert untouched
    for opt, kw in [("sgd", {"momentum": 0.9, "weight_decay": 0.01}), ("adam", {})]:
        result, _ = train(cfg(optimizer=opt, optimizer_kwargs=kw, lr=0.05), data)
        for name in ("users", "items"):
            w = getattr(result.model, name).weight.detach()
            w0 = getattr(build(), name).weight.detach()
            assert torch.equal(w[untouched], w0[untouched]), (opt, name)
            assert not torch.equal(w, w0)
        assert result.summary["ps"]["rows_pushed"] > 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("mode", "extra"), [("async", {}), ("ssp", {"staleness": 1})])
def test_async_and_ssp_train_with_sparse_rows(mode, extra):
    data = parts([12, 12])
    result, _ = train(cfg(ps_mode=mode, lr=0.1, **extra), data)
    s = result.summary["ps"]
    assert s["mode"] == mode and s["rows_pushed"] > 0 and s["failure"] is None
    assert s["max_ssp_gap"] <= 1
    assert all(math.isfinite(h["loss"]) for h in result.history)


# ---------------------------------------------------------------------- the wire


def _clients(server: ParameterServer, rank: int = 0):
    n = server.ranges[-1][1]
    return ps_clients(server, rank, ranges=dense_ranges(n, len(server.addresses), True))


@pytest.mark.timeout(30)
def test_pulled_rows_are_the_servers_and_a_push_moves_only_its_rows():
    c = cfg(num_workers=1, ps_shards=3, lr=0.5)
    model = build(rows=10, dtype=torch.float32)
    with start_parameter_server(
        model, c, host=HOST, secret=SECRET, job_id="job", attempt=0
    ) as server:
        clients = _clients(server)
        try:
            assert [t.lo for t in server.shards[2].tables] == [7, 7]  # rows 7..9 of each
            before = server.table(1).copy()
            for cl in clients:
                flat = np.empty(cl.hi - cl.lo, np.float32)
                cl.pull(-1, flat)
                table = cl.index  # shard i: pull two of its rows of the items table
                lo = server.shards[cl.index].tables[1].lo
                ids = np.array([1, 0], np.int64)
                out = np.empty((2, 3), np.float32)
                cl.pull_rows(1, ids, out)
                np.testing.assert_array_equal(out, before[lo + ids])
                del table
            # one step from shard 1: rows 4 and 6 of the items table (local 0 and 2)
            grads = np.ones((2, 3), np.float32)
            empty = (np.empty(0, np.int64), np.empty((0, 3), np.float32))
            for cl in clients:
                dense = np.zeros(cl.hi - cl.lo, np.float32)
                rows = [empty, (np.array([0, 2], np.int64), grads) if cl.index == 1 else empty]
                assert cl.push(0, 5, dense, rows=rows) == protocol.OK
            after = server.table(1)
            moved = np.flatnonzero(np.any(after != before, axis=1)).tolist()
            assert moved == [4, 6]
            np.testing.assert_allclose(after[[4, 6]], before[[4, 6]] - 0.5, rtol=1e-6)
            # ids out of order break the protocol: the connection is dropped
            bad = [empty, (np.array([2, 0], np.int64), grads)]
            with pytest.raises(CommError):
                clients[1].push(1, 5, np.zeros(clients[1].hi - clients[1].lo, np.float32), rows=bad)
        finally:
            for cl in clients:
                cl.close()


@pytest.mark.timeout(120)
def test_bytes_per_step_follow_the_touched_rows_not_the_table_size():
    data = parts([16, 16], rows=40)  # ids < 40 whatever the table size
    wire = {}
    for rows, mode in [(1_000, "auto"), (100_000, "auto"), (100_000, "off")]:
        c = cfg(epochs=1, batch_size=8, lr=0.1, sparse_embeddings=mode)
        result, _ = train(c, data, rows=rows, dtype=torch.float32)
        s = result.summary["ps"]
        wire[rows, mode] = s["bytes_in"] + s["bytes_out"]
    small, big, dense = wire[1_000, "auto"], wire[100_000, "auto"], wire[100_000, "off"]
    assert abs(big - small) / small < 0.05, wire  # 100x the rows, the same bytes
    assert dense > 100 * big, wire  # whole tables: 2 x 100k x 3 floats each way per step


# ---------------------------------------------------------------------- checkpoints


@pytest.mark.timeout(120)
def test_a_resumed_server_continues_with_its_rows_and_adagrad_state(tmp_path):
    data = parts([8, 8])
    c = cfg(optimizer=torch.optim.Adagrad, epochs=2, batch_size=4)
    straight, _ = train(c, data)
    # one epoch, checkpoint the server, a new server restores it and runs epoch 2
    first, server = train(dataclasses.replace(c, epochs=1), data)
    store = CheckpointStore(str(tmp_path))
    state = server.state()
    assert len(state["shards"][0]["tables"]) == 2
    store.save(persist.to_checkpoint(state, list(first.history)))
    fresh = start_parameter_server(build(), c, host=HOST, secret=SECRET, job_id="job", attempt=0)
    step, _ = persist.restore(store, fresh) or (None, None)
    assert step == 2  # 8 rows / batch 4
    for a, b in zip(server.shards, fresh.shards, strict=True):
        for ta, tb in zip(a.tables, b.tables, strict=True):
            assert torch.equal(ta.values, tb.values)
            sa = ta.optimizer.state_dict()["state"][0]["sum"]
            assert torch.equal(sa, tb.optimizer.state_dict()["state"][0]["sum"])
    resumed, _ = train(c, data, server=fresh, resume_step=step)
    assert_same(resumed.model, straight.model, 1e-12)


@pytest.mark.timeout(10)
def test_a_table_with_max_norm_is_refused_clearly():
    model = nn.Sequential(nn.Embedding(10, 2, sparse=True, max_norm=1.0), nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="max_norm=1.0 renormalises.*sparse_embeddings='off'"):
        start_parameter_server(model, cfg(), host=HOST, secret=SECRET, job_id="job", attempt=0)
