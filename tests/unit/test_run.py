"""``sparktrain.run``'s task side with ranks as threads: the context's collectives,
reports, early stopping, checkpoints and the distributed optimizer, against the built-in
loop and single-process references."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from sparktrain.builders import build_optimizer
from sparktrain.checkpoint import CheckpointStore
from sparktrain.errors import CommError, ConfigError
from sparktrain.models import mlp
from sparktrain.result import load_state_records
from sparktrain.task.faults import FaultPlan, InjectedFaultError
from sparktrain.task.run_context import RunContext
from sparktrain.task.run_task import decode_value, encode_value
from tests.unit.fixtures import (
    SEEDED_BUILD,
    loop_spec,
    random_parts,
    rank0_value,
    run_in_threads,
    seeded_mlp,
    train_in_threads,
)


def mlp_train_fn(ctx: RunContext) -> dict[str, Any]:
    """The built-in loop's arithmetic written as a train_fn."""
    cfg = ctx.config
    model = seeded_mlp(cfg.seed)
    optimizer = build_optimizer(cfg.optimizer, model.parameters(), cfg.lr, {})
    model, optimizer = ctx.distributed(model, optimizer)
    for epoch in range(cfg.epochs):
        total = rows = 0.0
        for batch in ctx.batches(epoch):
            loss = F.cross_entropy(model(batch.x), batch.y.long())
            ctx.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            total += loss.item() * len(batch)
            rows += len(batch)
        ctx.report(loss=total / rows)
    return {"state": model.state_dict(), "epochs": cfg.epochs, "note": ("a", 1)}


def test_a_train_fn_matches_the_builtin_loop() -> None:
    spec = loop_spec(batch_size=16, shuffle=True, epochs=2, lr=0.2)
    parts = random_parts([64, 64])
    builtin = [r for out in train_in_threads(spec, parts) for r in out]
    meta = json.loads(next(r.data for r in builtin if r.kind == "meta"))
    want = load_state_records(builtin, 0, meta)
    value, run_meta = rank0_value(run_in_threads(spec, parts, mlp_train_fn))
    assert value["epochs"] == 2 and value["note"] == ["a", 1]
    for name, tensor in want.items():
        torch.testing.assert_close(value["state"][name], tensor, rtol=0, atol=1e-6)
    assert [h["epoch"] for h in run_meta["history"]] == [0, 1]


def test_accumulated_steps_equal_the_larger_batch_in_float64() -> None:
    def train_fn(ctx: RunContext) -> dict[str, Any]:
        model = seeded_mlp(0).double()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
        model, optimizer = ctx.distributed(model, optimizer)
        for epoch in range(2):
            for batch in ctx.batches(epoch):
                loss = F.cross_entropy(model(batch.x.double()), batch.y.long())
                ctx.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
        return model.state_dict()

    parts = random_parts([64, 64], seed=3)
    small = loop_spec(batch_size=8, accumulate_steps=2, shuffle=False)
    large = loop_spec(batch_size=16, shuffle=False)
    got, _ = rank0_value(run_in_threads(small, parts, train_fn))
    want, _ = rank0_value(run_in_threads(large, parts, train_fn))
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-6)


def test_collectives_reduce_and_broadcast_on_every_rank() -> None:
    def train_fn(ctx: RunContext) -> dict[str, Any]:
        r = ctx.rank
        out = {
            "sum": ctx.allreduce(torch.tensor([1.0, r], dtype=torch.float64)),
            "mean": ctx.allreduce(torch.tensor([2.0 * r]), op="mean"),
            "max": ctx.allreduce(torch.tensor([r, -r], dtype=torch.int64), op="max"),
            "min": ctx.allreduce(torch.tensor([float(r)]), op="min"),
            "from1": ctx.broadcast(torch.full((3,), float(r), dtype=torch.bfloat16), src=1),
            "from0": ctx.broadcast(torch.arange(4) + 10 * r),
        }
        ctx.barrier()
        record = ctx.report(rows=float(r), peak=float(r), reduce={"peak": "max"})
        out["record"] = [record["rows"], record["peak"]]
        # every rank returns; only rank 0's value travels, so check the rest here
        assert torch.equal(out["from1"], torch.ones(3, dtype=torch.bfloat16))
        return out

    value, _ = rank0_value(
        run_in_threads(loop_spec(num_workers=3), random_parts([4, 4, 4]), train_fn)
    )
    assert value["sum"].tolist() == [3.0, 3.0]
    assert value["mean"].tolist() == [2.0]
    assert value["max"].tolist() == [2, 0]
    assert value["min"].tolist() == [0.0]
    assert value["from0"].tolist() == [0, 1, 2, 3]
    assert value["record"] == [1.0, 2.0]


def test_reports_with_other_names_on_a_rank_fail_on_every_rank() -> None:
    def train_fn(ctx: RunContext) -> None:
        ctx.report(**({"loss": 1.0} if ctx.rank == 0 else {"lost": 1.0}))

    with pytest.raises(ConfigError, match="same names"):
        run_in_threads(loop_spec(), random_parts([4, 4]), train_fn)


def test_early_stopping_is_agreed_by_every_rank_and_shows_in_the_history() -> None:
    aucs = [0.6, 0.7, 0.72, 0.71, 0.70, 0.69, 0.8]

    def train_fn(ctx: RunContext) -> dict[str, Any]:
        best = []
        for epoch, auc in enumerate(aucs):
            ctx.report(val_auc=auc + 0.001 * ctx.rank)  # ranks differ; the mean decides
            if ctx.improved:  # every rank knows: a collective may follow
                ctx.barrier()
                best.append(epoch)
            if ctx.should_stop:
                return {"stopped": epoch, "best": best}
        return {"stopped": -1, "best": best}

    spec = loop_spec(early_stopping={"metric": "val_auc", "patience": 3})
    outputs = run_in_threads(spec, random_parts([4, 4]), train_fn)
    value, meta = rank0_value(outputs)
    assert value == {"stopped": 5, "best": [0, 1, 2]}  # three reports without improvement
    assert meta["history"][5]["early_stop"] is True
    assert meta["early_stopping"]["best_epoch"] == 2


def resumable_train_fn(ctx: RunContext) -> dict[str, Any]:
    """Adam on the MLP, a checkpoint every epoch, continuing from ctx.restore()."""
    cfg = ctx.config
    model = seeded_mlp(cfg.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model, optimizer = ctx.distributed(model, optimizer)
    state = ctx.restore()
    start = 0
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["epoch"] + 1
    for epoch in range(start, cfg.epochs):
        for batch in ctx.batches(epoch):
            ctx.backward(F.cross_entropy(model(batch.x), batch.y.long()))
            optimizer.step()
            optimizer.zero_grad()
        ctx.report(epoch_done=float(epoch))
        ctx.checkpoint(
            {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}
        )
    return {"state": model.state_dict(), "started_at": start}


def test_a_killed_run_resumes_from_its_checkpoint(tmp_path: Any) -> None:
    parts = random_parts([48, 48], seed=5)
    base = dict(batch_size=16, epochs=4, lr_schedule="StepLR", lr_schedule_kwargs={"step_size": 4})
    clean = loop_spec(**base, checkpoint_dir=str(tmp_path / "clean"))
    want, _ = rank0_value(run_in_threads(clean, parts, resumable_train_fn))

    spec = loop_spec(**base, checkpoint_dir=str(tmp_path / "killed"))
    marker = str(tmp_path / "fired")
    with pytest.raises((InjectedFaultError, CommError)):  # the first rank's error surfaces
        run_in_threads(
            dataclasses.replace(spec, fault=FaultPlan(1, 7, marker)), parts, resumable_train_fn
        )
    assert os.path.exists(marker)
    step = CheckpointStore(spec.config.checkpoint_dir).newest_intact()
    assert step == 6  # after epoch 1 (3 steps an epoch)
    resumed = dataclasses.replace(spec, resume_step=step)
    got, meta = rank0_value(run_in_threads(resumed, parts, resumable_train_fn))
    assert got["started_at"] == 2
    assert [h["epoch_done"] for h in meta["history"]] == [0.0, 1.0, 2.0, 3.0]
    for name, tensor in want["state"].items():
        torch.testing.assert_close(got["state"][name], tensor, rtol=0, atol=0)


def test_return_values_travel_as_json_and_tensors() -> None:
    value = {"a": [1, 2.5, "x", None, True], "t": torch.arange(3), "n": np.ones(2), "k": (1,)}
    skeleton, tensors = encode_value(value)
    json.dumps(skeleton)  # JSON-able
    back = decode_value(skeleton, tensors)
    assert back["a"] == [1, 2.5, "x", None, True] and back["k"] == [1]
    assert torch.equal(back["t"], torch.arange(3))
    assert torch.equal(back["n"], torch.ones(2, dtype=torch.float64))
    with pytest.raises(ConfigError, match="state_dict"):
        encode_value({"model": torch.nn.Linear(1, 1)})
    with pytest.raises(ConfigError, match="keys must be strings"):
        encode_value({1: 2})


def test_a_train_fn_under_ps_starts_the_server_from_rank_0_and_matches_the_ring() -> None:
    from sparktrain.strategies.ps.bootstrap import Bootstrap
    from sparktrain.strategies.ps.server import ParameterServer

    common = dict(batch_size=16, shuffle=True, epochs=2, lr=0.2, lr_schedule="StepLR")
    common["lr_schedule_kwargs"] = {"step_size": 3, "gamma": 0.5}
    parts = random_parts([64, 48])
    want, _ = rank0_value(run_in_threads(loop_spec(**common), parts, mlp_train_fn))
    spec = loop_spec(**common, strategy="ps", ps_mode="sync")
    servers: list[ParameterServer] = []

    def start(values: np.ndarray, cfg: Any, tables: Any) -> None:
        servers.append(
            ParameterServer(
                values,
                cfg,
                host="127.0.0.1",
                secret=spec.secret,
                job_id="t",
                attempt=0,
                tables=tables,
            )
        )
        assert tables == []  # an MLP: no sparse tables, the dense path as before

    def current() -> Any:
        return (list(servers[0].addresses), servers[0].completed_step()) if servers else None

    boot = Bootstrap(
        "127.0.0.1",
        secret=spec.secret,
        job_id="t",
        attempt=lambda: 0,
        security=None,
        start=start,
        current=current,
        config=spec.config,
    )
    try:
        got, _ = rank0_value(
            run_in_threads(
                dataclasses.replace(spec, ps_bootstrap=boot.address), parts, mlp_train_fn
            )
        )
    finally:
        boot.stop()
        for server in servers:
            server.stop()
    assert len(servers) == 1 and servers[0].cfg.optimizer.__name__ == "SGD"
    for name, tensor in want["state"].items():
        torch.testing.assert_close(got["state"][name], tensor, rtol=1e-5, atol=1e-5)


def test_batches_from_a_start_step_are_the_tail_of_the_epoch() -> None:
    def train_fn(ctx: RunContext) -> dict[str, Any]:
        whole = [b.x.clone() for b in ctx.batches(1)]
        tail = [b.x.clone() for b in ctx.batches(1, start=2)]
        return {"whole": whole, "tail": tail, "global_step": ctx.global_step}

    spec = loop_spec(batch_size=8, shuffle=True)
    value, _ = rank0_value(run_in_threads(spec, random_parts([40, 40]), train_fn))
    assert len(value["whole"]) == 5 and len(value["tail"]) == 3
    for got, want in zip(value["tail"], value["whole"][2:], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert value["global_step"] == 8
    with pytest.raises(ConfigError, match="start=6"):
        run_in_threads(spec, random_parts([40, 40]), lambda ctx: list(ctx.batches(0, start=6)))


def test_idle_ranks_join_each_step_without_rows_so_every_row_counts_once() -> None:
    """Ranks of 12 and 4 rows, batches of 4: rank 1 idles in steps 2 and 3. Each step is
    then one SGD step on the union of the rows the ranks hold for it."""

    def train_fn(ctx: RunContext) -> dict[str, Any]:
        model = seeded_mlp(0).double()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        model, optimizer = ctx.distributed(model, optimizer)
        seen = []
        for batch in ctx.batches(0, uneven="idle"):
            seen.append(batch is not None)
            if batch is not None:
                ctx.backward(F.cross_entropy(model(batch.x.double()), batch.y.long()))
            optimizer.step()
        return {"state": model.state_dict(), "seen": seen}

    parts = random_parts([12, 4], seed=5)
    spec = loop_spec(batch_size=4, shuffle=False, epochs=1)
    outputs = run_in_threads(spec, parts, train_fn)
    value, _ = rank0_value(outputs)
    assert value["seen"] == [True, True, True]

    reference = seeded_mlp(0).double()
    sgd = torch.optim.SGD(reference.parameters(), lr=0.5)
    for step in range(3):
        rows = [p for p in parts if len(p.y) > 4 * step]
        x = torch.from_numpy(np.concatenate([p.x[4 * step : 4 * step + 4] for p in rows]))
        y = torch.from_numpy(np.concatenate([p.y[4 * step : 4 * step + 4] for p in rows]))
        sgd.zero_grad()
        F.cross_entropy(reference(x.double()), y.long()).backward()
        sgd.step()
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(value["state"][name], tensor, rtol=0, atol=1e-9)

    def seen_on_rank_1(ctx: RunContext) -> list[bool]:
        return [b is not None for b in ctx.batches(0, uneven="idle")] if ctx.rank else []

    def repeat_on_rank_1(ctx: RunContext) -> list[int]:
        return [len(b) for b in ctx.batches(0)] if ctx.rank else []

    assert run_partition_values(spec, parts, seen_on_rank_1)[1] == [True, False, False]
    assert run_partition_values(spec, parts, repeat_on_rank_1)[1] == [4, 4, 4]


def run_partition_values(spec: Any, parts: list[Any], train_fn: Any) -> list[Any]:
    """Every rank's return value (the harness calls the train_fn through the context)."""
    got: list[Any] = [None] * len(parts)

    def keep(ctx: RunContext) -> None:
        got[ctx.rank] = train_fn(ctx)

    run_in_threads(spec, parts, keep)
    return got


def test_distributed_broadcasts_rank_0_only_when_the_replicas_differ() -> None:
    def build(seed: int) -> torch.nn.Module:
        with SEEDED_BUILD:
            torch.manual_seed(seed)
            return mlp(64, (256,), 10)  # 19 k parameters: far more than two checksums

    def train_fn(ctx: RunContext, seed_of_rank: Any) -> dict[str, Any]:
        model = build(seed_of_rank(ctx.rank))
        before = ctx.mesh.stats.as_dict()["wire_bytes_recv"]
        ctx.distributed(model, torch.optim.SGD(model.parameters(), lr=0.1))
        received = ctx.mesh.stats.as_dict()["wire_bytes_recv"] - before
        return {"state": model.state_dict(), "received": received}

    spec = loop_spec()
    parts = random_parts([8, 8])
    model_bytes = sum(t.numel() * t.element_size() for t in build(0).state_dict().values())
    same = run_partition_values(spec, parts, lambda ctx: train_fn(ctx, lambda r: 0))
    assert all(v["received"] < model_bytes / 4 for v in same)  # two checksum rounds only
    differ = run_partition_values(spec, parts, lambda ctx: train_fn(ctx, lambda r: r))
    assert differ[1]["received"] >= model_bytes
    for name, tensor in differ[0]["state"].items():
        torch.testing.assert_close(differ[1]["state"][name], tensor, rtol=0, atol=0)


def test_progress_reaches_the_driver_from_rank_0_with_the_step_of_the_epoch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sent: list[dict[str, Any]] = []

    class Reporter:
        def step_due(self) -> bool:
            return True

        def send(self, message: dict[str, Any]) -> None:
            sent.append(message)

        def close(self) -> None:
            pass

    monkeypatch.setattr("sparktrain.task.run_task.start_reporter", lambda *a, **k: Reporter())

    def train_fn(ctx: RunContext) -> None:
        for epoch in range(2):
            for _batch in ctx.batches(epoch):
                ctx.progress(loss=0.5)
            ctx.report(loss=1.0)

    run_in_threads(loop_spec(batch_size=8), random_parts([24, 24]), train_fn)
    steps = [(m["epoch"], m["step"]) for m in sent if m["type"] == "step"]
    assert steps == [(0, 1), (0, 2), (0, 3), (1, 1), (1, 2), (1, 3)]
    step = next(m for m in sent if m["type"] == "step")
    assert step["steps_per_epoch"] == 3 and step["loss"] == 0.5 and step["samples_per_s"] > 0
    assert [m["type"] for m in sent].count("report") == 2


def test_a_loss_diverging_in_an_epochs_last_step_names_that_epoch_and_step() -> None:
    def train_fn(ctx: RunContext) -> None:
        model = seeded_mlp(0)
        ctx.distributed(model, torch.optim.SGD(model.parameters(), lr=0.1))
        for i, batch in enumerate(ctx.batches(0)):
            loss = F.cross_entropy(model(batch.x), batch.y.long())
            ctx.backward(loss * float("nan") if i == 2 else loss)

    with pytest.raises(Exception, match="epoch 1, step 3 of 3"):
        run_in_threads(loop_spec(batch_size=8), random_parts([24, 24]), train_fn)
