"""``sparktrain.run`` with ``strategy="ps"`` on a model with ``sparse=True`` tables: the
server, started from rank 0's model through the bootstrap, serves the tables by rows
as for the built-in loop (docs/sparse_ps.md). Ranks as threads, real sockets, no Spark."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from sparktrain.config import TrainConfig
from sparktrain.strategies.ps.bootstrap import Bootstrap
from sparktrain.strategies.ps.server import ParameterServer
from sparktrain.task.run_context import RunContext

from .fixtures import HOST, SECRET, SEEDED_BUILD, rank0_value, run_in_threads
from .sparse_ps_fixtures import build, cfg, parts, spec, torch_reference


def train_fn(rows: int, dtype: torch.dtype, with_state: bool, ctx: RunContext) -> dict[str, Any]:
    """SGD over the run's batches; rank 0's model state (``with_state``) and the wire
    bytes its steps after the first moved (the first step's pulls fill the caches)."""
    c = ctx.config
    with SEEDED_BUILD:  # the ranks are threads of one process: one global torch RNG
        model = build(rows, True, dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=c.lr)
    model, optimizer = ctx.distributed(model, optimizer)
    wire: list[int] = []
    for epoch in range(c.epochs):
        for batch in ctx.batches(epoch):
            loss = F.cross_entropy(model(batch.x), batch.y.long())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            s = ctx.mesh.stats.as_dict()
            wire.append(s["wire_bytes_sent"] + s["wire_bytes_recv"])
    per_step = (wire[-1] - wire[0]) / (len(wire) - 1)
    out: dict[str, Any] = {"bytes_per_step": per_step, "steps": len(wire)}
    if with_state:  # the returned tables: the server's, pulled after the train_fn
        out["state"] = model.state_dict()
    return out


def run_ps(
    c: TrainConfig,
    data: list[Any],
    rows: int = 40,
    dtype: torch.dtype = torch.float64,
    with_state: bool = True,
) -> tuple[dict[str, Any], ParameterServer]:
    """``train_fn`` under ``sparktrain.run``'s task side, the server started by a
    :class:`Bootstrap` in this process as the driver's ps strategy does."""
    servers: list[ParameterServer] = []
    job = spec(c, (), functools.partial(build, rows, True, dtype))

    def start(values: np.ndarray, server_cfg: TrainConfig, tables: Any) -> None:
        servers.append(
            ParameterServer(
                values,
                server_cfg,
                host=HOST,
                secret=SECRET,
                job_id=job.job_id,
                attempt=0,
                tables=tables,
            )
        )

    def current() -> Any:
        return (list(servers[0].addresses), servers[0].completed_step()) if servers else None

    boot = Bootstrap(
        HOST,
        secret=SECRET,
        job_id=job.job_id,
        attempt=lambda: 0,
        security=None,
        start=start,
        current=current,
        config=c,
    )
    try:
        job = dataclasses.replace(job, ps_bootstrap=boot.address)
        value, _ = rank0_value(
            run_in_threads(job, data, functools.partial(train_fn, rows, dtype, with_state))
        )
    finally:
        boot.stop()
        for server in servers:
            server.stop()
    assert len(servers) == 1
    return value, servers[0]


@pytest.mark.timeout(120)
def test_run_serves_sparse_tables_by_rows_and_matches_the_dense_ps_run() -> None:
    data = parts([13, 6])  # uneven: rank 1 runs out of rows and joins with none
    sparse, server = run_ps(cfg(), data)
    dense, dense_server = run_ps(cfg(sparse_embeddings="off"), data)
    assert [name for name, _ in server.table_values] == ["users.weight", "items.weight"]
    assert dense_server.table_values == []
    for name, want in dense["state"].items():
        torch.testing.assert_close(sparse["state"][name], want, rtol=1e-6, atol=1e-6, msg=name)
    # and the single-process torch reference (dense gradients on the ranks' union) on
    # even partitions (the run's schedule for uneven ones is not the reference's)
    even = parts([12, 12])
    ref = torch_reference(cfg(), even)
    got, _ = run_ps(cfg(), even)
    for name, want in ref.state_dict().items():
        torch.testing.assert_close(got["state"][name], want, rtol=1e-6, atol=1e-6, msg=name)
    stats = server.stats()
    assert stats["rows_pushed"] > 0 and stats["rows_pulled"] > 0
    assert dense_server.stats()["rows_pushed"] == 0
    # rank 0's returned tables are the server's, whole (pulled before the value left)
    users = sparse["state"]["users.weight"].numpy()
    np.testing.assert_array_equal(users, server.table(0))
    # the tables moved (the comparisons above are not vacuous)
    assert not torch.equal(sparse["state"]["items.weight"], build().items.weight.detach())


@pytest.mark.timeout(120)
def test_run_bytes_per_step_follow_the_touched_rows_not_the_table_size() -> None:
    data = parts([16, 16], rows=40)  # ids < 40 whatever the table size
    per_step = {}
    for rows, mode in [(1_000, "auto"), (100_000, "auto"), (100_000, "off")]:
        c = cfg(epochs=1, batch_size=4, lr=0.1, sparse_embeddings=mode)
        value, server = run_ps(c, data, rows=rows, dtype=torch.float32, with_state=False)
        assert value["steps"] == 4
        # no tables in the value: no end-of-run pull of them (ids < 40: few rows pulled)
        assert server.stats()["rows_pulled"] < rows, server.stats()
        per_step[rows, mode] = value["bytes_per_step"]
    small, big, dense = per_step[1_000, "auto"], per_step[100_000, "auto"], per_step[100_000, "off"]
    assert abs(big - small) / small < 0.05, per_step  # 100x the rows, the same bytes
    assert dense > 100 * big, per_step  # whole tables: 2 x 100k x 3 floats each way a step
