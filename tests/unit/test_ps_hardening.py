"""Parameter-server hardening without Spark: payloads in chunks under a tiny frame cap,
a rank that reconnects after a reset, and checkpoints of the server that a new server
resumes from without applying any step twice."""

from __future__ import annotations

import functools
import json
import socket
import struct
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
import torch

from sparktrain.checkpoint import CheckpointStore
from sparktrain.config import TrainConfig
from sparktrain.errors import FrameError
from sparktrain.models import mlp
from sparktrain.result import assemble as _assemble
from sparktrain.strategies.ps import protocol
from sparktrain.strategies.ps import server_persist as persist
from sparktrain.strategies.ps.client import connect_shards
from sparktrain.strategies.ps.server import ParameterServer, start_parameter_server
from sparktrain.task.context import JobSpec, WorkerContext
from sparktrain.task.run_task import run_partition
from sparktrain.wire.frames import HEADER_BYTES
from sparktrain.wire.stats import CommStats

from .fixtures import HOST, SECRET, ps_cfg, ps_clients, random_parts, run_ranks

CAP = 4096  # bytes per frame: every shard below is several times larger
# a rank's clients of every shard, their frames capped at CAP
_clients = functools.partial(ps_clients, max_frame_bytes=CAP)
WIDE = functools.partial(mlp, 4, (128, 128), 3)  # 17,539 float32 parameters, 70 KB


def _wide_model(cfg: TrainConfig) -> torch.nn.Module:
    torch.manual_seed(cfg.seed)
    return WIDE()


def _start(cfg: TrainConfig, world: int = 2, **kwargs) -> ParameterServer:
    return start_parameter_server(
        _wide_model(cfg), cfg, host=HOST, secret=SECRET, job_id="job", attempt=0,
        world_size=world, **kwargs,
    )  # fmt: skip


def _train(cfg: TrainConfig, parts, server: ParameterServer, resume_step: int | None = None):
    """Train the wide MLP in threads against ``server`` (left running)."""
    spec = JobSpec(
        job_id="job",
        attempt=0,
        secret=SECRET,
        config=cfg,
        model_fn=WIDE,
        model_kwargs={},
        feature_width=4,
        num_outputs=3,
        ps_addresses=tuple(server.addresses),
        resume_step=resume_step,
    )

    def rank_fn(rank, coll):
        ctx = WorkerContext(
            rank, len(parts), HOST, functools.partial(coll.all_gather, rank), coll.barrier, spec
        )
        return run_partition(ctx, parts[rank])

    records = [r for out in run_ranks(len(parts), rank_fn, timeout=90) for r in out]
    result = _assemble(_wide_model(cfg), records, cfg, wall_s=1.0, stage_s=1.0)
    server.finish(result)
    stats = [json.loads(r.data) for r in records if r.kind == "stats"]
    # autograd accumulated into the bound views: the pushes copied no gradient
    assert all(st["ps_grad_copies"] == 0 for st in stats)
    return result


# ---------------------------------------------------------------------- chunks


@pytest.mark.timeout(30)
def test_a_push_and_a_pull_travel_in_chunks_of_the_servers_size():
    cfg = ps_cfg(ps_mode="async", ps_shards=1, lr=0.5)
    with _start(cfg, world=1, max_frame_bytes=CAP) as server:
        (client,) = _clients(server)
        shard = server.shards[0]
        n = client.hi - client.lo
        assert n * 4 > 10 * CAP  # the precondition: one frame could not carry it
        chunks = -(-n * 4 // CAP)
        flat = np.zeros(n, np.float32)
        frames = shard.stats.frames_sent
        assert client.pull(-1, flat) == protocol.FULL
        # reply header + chunks; the shard counts its last frame once sendall returned,
        # which may be just after the client has read it
        _settles(lambda: shard.stats.frames_sent - frames, 1 + chunks)
        np.testing.assert_array_equal(flat, server.parameters())
        assert client.chunk_bytes == CAP  # named by the shard in its reply
        received = shard.stats.frames_recv
        grad = np.linspace(-1, 1, n, dtype=np.float32)
        assert client.push(0, 2, grad) == protocol.OK
        assert shard.stats.frames_recv - received == 1 + chunks  # push header + chunks
        assert client.pull(0, flat) == protocol.DELTA
        np.testing.assert_array_equal(flat, server.parameters())  # the mirror stays exact
        np.testing.assert_allclose(flat, _wide_flat(cfg) - 0.5 * grad, rtol=1e-6, atol=1e-6)
        s = server.stats()
        assert s["push"]["payload_bytes"] == chunks * HEADER_BYTES + n * 4


def _settles(count: Callable[[], int], want: int, within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while count() != want and time.monotonic() < deadline:
        time.sleep(0.01)
    assert count() == want


def _wide_flat(cfg: TrainConfig) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in _wide_model(cfg).parameters()]).numpy()


@pytest.mark.timeout(30)
def test_a_chunk_above_the_receivers_cap_is_refused_clearly():
    cfg = ps_cfg(ps_mode="async", ps_shards=1)
    with _start(cfg, world=1, max_frame_bytes=1 << 20, chunk_bytes=64 << 10) as server:
        (client,) = _clients(server)  # this worker's frames are capped at 4 KiB
        flat = np.zeros(client.hi - client.lo, np.float32)
        with pytest.raises(FrameError, match="above this side's frame cap of 4096 bytes"):
            client.pull(-1, flat)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["sync", "async", "ssp"])
@pytest.mark.parametrize("spec", ["none", "int8+ef", "delta+int8"])
def test_training_under_a_tiny_frame_cap_moves_every_payload_in_chunks(mode, spec):
    """The server's connections refuse any frame above 4 KiB in either direction, and
    every shard (35 KB), compressed push (~9 KB) and delta+ pull is larger: the run only
    finishes if every payload went in chunks."""
    cfg = ps_cfg(ps_mode=mode, ps_shards=2, compression=spec, staleness=1, epochs=2, lr=0.05)
    parts = random_parts([16, 12])
    with _start(cfg, max_frame_bytes=CAP) as server:
        assert min(hi - lo for lo, hi in server.ranges) * 4 > 8 * CAP
        result = _train(cfg, parts, server)
    s = result.summary
    steps = 2 * s["steps_per_epoch"]
    assert s["ps"]["failure"] is None and s["ps"]["rejected"] == 0
    assert s["ps"]["pushes"] == steps * 2 * 2
    frames = sum(sh.stats.frames_recv for sh in server.shards)
    assert frames > 2 * s["ps"]["pushes"]  # several frames per payload
    assert s["ps_version"] == s["ps_applied_pushes"] > 0
    assert np.isfinite(s["final_loss"])
    if mode == "sync":
        assert s["ps_version"] == steps and s["replicas_in_sync"]
        # exact sync pulls send the shard's values: no per-rank mirror is kept
        mirrors = [st.mirror is None for sh in server.shards for st in sh.ranks.values()]
        assert all(mirrors) == (spec != "delta+int8")
        if spec == "none":  # chunking changes nothing but the framing
            with _start(cfg) as plain:
                want = _train(cfg, parts, plain)
            for a, b in zip(result.model.parameters(), want.model.parameters(), strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.timeout(60)
def test_a_model_larger_than_the_frame_cap_trains_through_one_shard():
    """One shard holding the whole model (70 KB) behind a 4 KiB cap: the PS carries a
    model that exceeds the frame cap, as it must for a 150M-parameter model behind 1 GiB."""
    cfg = ps_cfg(ps_mode="sync", ps_shards=1, epochs=1)
    with _start(cfg, max_frame_bytes=CAP) as server:
        n = server.ranges[-1][1]
        assert server.ranges == [(0, n)] and n * 4 > 17 * CAP  # 17,539 elements
        result = _train(cfg, random_parts([8, 8]), server)
    assert result.summary["ps_version"] == result.summary["ps_applied_pushes"] == 2
    np.testing.assert_array_equal(
        torch.cat([p.detach().reshape(-1) for p in result.model.parameters()]).numpy(),
        server.parameters(),
    )


# ---------------------------------------------------------------------- reconnecting


def _reset(conn) -> None:
    """Close ``conn``'s socket with an RST (SO_LINGER 0), as a middlebox reset does."""
    conn._sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.close()


@pytest.mark.timeout(30)
def test_a_rank_whose_connection_is_reset_reconnects_and_no_push_is_applied_twice():
    cfg = ps_cfg(ps_mode="sync", ps_shards=1, lr=0.5)
    with _start(cfg, world=2, max_frame_bytes=CAP) as server:
        (c0,), (c1,) = _clients(server, 0), _clients(server, 1)
        flats = [np.zeros(c0.hi - c0.lo, np.float32) for _ in range(2)]
        for c, flat in zip((c0, c1), flats, strict=True):
            c.pull(-1, flat)
        start = flats[0].copy()
        grad = np.full_like(start, 0.125)
        shard = server.shards[0]

        # step 0: the shard applies rank 0's push, then the connection is reset before the
        # acknowledgement goes out; the client reconnects and resends the same step
        conn = shard._conns[0]
        send = conn.send_bytes

        def reset_instead_of_ack(payload: bytes, kind: int) -> None:
            if kind == protocol.KIND_ACK:
                _reset(conn)
                raise OSError("reset by the test")
            send(payload, kind)

        conn.send_bytes = reset_instead_of_ack  # type: ignore[method-assign]
        assert c1.push(0, 1, grad) == protocol.OK
        assert c0.push(0, 1, grad) == protocol.DUPLICATE  # applied before the reset: not again
        assert c0.reconnects == 1 and shard._conns[0] is not conn
        for step in range(3):
            if step:
                assert c0.push(step, 1, grad) == protocol.OK
                assert c1.push(step, 1, grad) == protocol.OK
            for c, flat in zip((c0, c1), flats, strict=True):
                c.pull(step, flat)
            if step == 1:  # a reset between requests: the next one reconnects
                _reset(shard._conns[1])
        s = server.stats()
        assert s["failure"] is None and s["reconnects"] == 2 and s["duplicates"] == 1
        assert s["version"] == s["applied_pushes"] == 3  # three steps, each applied once
        np.testing.assert_allclose(flats[0], start - 3 * 0.5 * grad, rtol=1e-6)
        np.testing.assert_array_equal(flats[0], server.parameters())
        np.testing.assert_array_equal(flats[1], server.parameters())


@pytest.mark.timeout(30)
def test_a_pull_waiting_when_the_connection_resets_is_answered_on_the_new_one():
    """sync, delta+int8: rank 0 waits on its pull when its connection is reset; it dials
    again and pulls there. The handler of the old connection must leave the rank's mirror
    alone, or the compressed deltas would no longer match the worker's copy."""
    cfg = ps_cfg(ps_mode="sync", ps_shards=1, lr=0.5, compression="delta+int8")
    with _start(cfg, world=2, max_frame_bytes=CAP) as server:
        (c0,), (c1,) = _clients(server, 0, "delta+int8"), _clients(server, 1, "delta+int8")
        shard = server.shards[0]
        flats = [np.zeros(c0.hi - c0.lo, np.float32) for _ in range(2)]
        for c, flat in zip((c0, c1), flats, strict=True):
            c.pull(-1, flat)
        rng = np.random.default_rng(0)
        assert c0.push(0, 1, rng.standard_normal(flats[0].size).astype(np.float32)) == protocol.OK
        got: list[object] = []
        waiting = threading.Thread(target=lambda: got.append(c0.pull(0, flats[0])))
        waiting.start()
        time.sleep(0.3)  # rank 0's pull is waiting for rank 1's step 0
        _reset(shard._conns[0])
        time.sleep(0.2)  # the client saw the reset and waits again on a new connection
        assert c1.push(0, 1, rng.standard_normal(flats[0].size).astype(np.float32)) == protocol.OK
        c1.pull(0, flats[1])
        waiting.join(10)
        assert got == [protocol.FULL] and c0.reconnects == 1
        for step in range(1, 4):  # compressed deltas from here on: mirrors must match
            for c in (c0, c1):
                grad = rng.standard_normal(flats[0].size).astype(np.float32)
                assert c.push(step, 1, grad) == protocol.OK
            for c, flat in zip((c0, c1), flats, strict=True):
                assert c.pull(step, flat) == protocol.CDELTA
        for rank in (0, 1):
            np.testing.assert_array_equal(flats[rank], shard.ranks[rank].mirror)
        s = server.stats()
        assert s["failure"] is None and s["version"] == s["applied_pushes"] == 4


@pytest.mark.timeout(30)
def test_a_new_stage_attempt_continues_the_step_count_and_resent_steps_are_duplicates():
    """async: rank 0 got 5 steps in, rank 1 only 3 when the stage failed. The next attempt
    starts every rank at step 3 (the steps every rank pushed); rank 0's resent steps 3
    and 4 are acknowledged, not applied again."""
    cfg = ps_cfg(ps_mode="async", ps_shards=1, lr=0.5)
    with _start(cfg, world=2) as server:
        (c0,), (c1,) = _clients(server, 0), _clients(server, 1)
        grad = np.full(c0.hi - c0.lo, 0.125, np.float32)
        for step in range(5):
            assert c0.push(step, 1, grad) == protocol.OK
        for step in range(3):
            assert c1.push(step, 1, grad) == protocol.OK
        assert server.completed_step() == 3
        server.begin_attempt(1)
        assert server.completed_step() == 3  # the ledger survives the new attempt
        n = server.ranges[-1][1]
        d0, d1 = (
            connect_shards(
                server.addresses, rank=r, secret=SECRET, job_id="job", attempt=1,
                timeout=5.0, stats=CommStats(), num_elements=n, dtype=np.dtype(np.float32),
            )[0]
            for r in (0, 1)
        )  # fmt: skip
        try:
            assert [d0.push(s, 1, grad) for s in (3, 4, 5)] == [
                protocol.DUPLICATE,
                protocol.DUPLICATE,
                protocol.OK,
            ]
            assert [d1.push(s, 1, grad) for s in (3, 4, 5)] == [
                protocol.OK,
                protocol.OK,
                protocol.OK,
            ]
        finally:
            d0.close()
            d1.close()
        s = server.stats()
        assert s["version"] == s["applied_pushes"] == 12  # 6 steps of 2 ranks, each once
        assert s["duplicates"] == 2 and server.completed_step() == 6


# ---------------------------------------------------------------------- checkpoints


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_new_server_resumes_from_the_checkpoint_and_applies_no_step_twice(tmp_path, mode):
    cfg = ps_cfg(
        ps_mode=mode, ps_shards=2, epochs=4, optimizer="adam", lr=0.01,
        checkpoint_dir=str(tmp_path), checkpoint_every=1.0, shuffle=False,
    )  # fmt: skip
    parts = random_parts([16, 16])
    with _start(cfg) as full_server:
        full = _train(cfg, parts, full_server)
    spe = full.summary["steps_per_epoch"]
    total = cfg.epochs * spe

    # the first run stops after two epochs; its server state goes to the checkpoint
    half = TrainConfig(**{**cfg.to_dict(), "epochs": 2})
    with _start(half) as first:
        done = _train(half, parts, first)
        store = persist.server_store(cfg)
        assert store is not None and store.uri == f"{tmp_path}/ps"
        saver = persist.ServerCheckpointer(
            first, store, cfg.checkpoint_every, lambda: spe, lambda at: tuple(done.history)
        )
        waiting = persist.ServerCheckpointer(
            first, store, cfg.checkpoint_every, lambda: spe, lambda at: done.history[:1]
        )
        assert waiting.maybe_save() is None  # epoch 2's record has not arrived: not yet
        assert saver.maybe_save() == 2 * spe
        assert saver.maybe_save() is None  # nothing new to save
        before = first.stats()
    assert before["version"] == before["applied_pushes"] > 0
    assert CheckpointStore(str(tmp_path)).steps() == []  # the workers' directory is untouched

    with _start(cfg) as second:
        resumed = persist.restore(store, second)
        assert resumed is not None
        step, history = resumed
        assert step == 2 * spe and len(history) == 2
        np.testing.assert_array_equal(second.parameters(), first.parameters())
        assert second.stats()["version"] == before["version"]
        result = _train(cfg, parts, second, resume_step=step)
    s = result.summary
    assert s["ps_version"] == s["ps_applied_pushes"]
    if mode == "sync":  # every step exactly once, and the same model as an unbroken run
        assert s["ps_version"] == total
        for a, b in zip(result.model.parameters(), full.model.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    else:  # every rank's every step with samples, once per shard
        assert s["ps_version"] == total * 2
    assert s["ps"]["duplicates"] == 0


class _TornServer:
    """A sync server whose snapshot caught shard 1 a step ahead of shard 0: the shards
    are copied one after another while the ranks go on pushing."""

    def __init__(self, versions: list[int]) -> None:
        self.versions = versions

    def completed_step(self) -> int:
        return min(self.versions)

    def state(self) -> dict:
        shard = {"values": torch.zeros(2), "optimizer": {}, "applied": [], "last_steps": [],
                 "rank_applied": [], "staleness": {}}  # fmt: skip
        return {
            "mode": "sync", "world_size": 2, "ranges": [[0, 2], [2, 4]],
            "shards": [{**shard, "version": v} for v in self.versions],
        }  # fmt: skip


@pytest.mark.timeout(30)
def test_a_torn_sync_snapshot_is_not_saved_and_the_next_poll_takes_an_even_one(tmp_path):
    cfg = ps_cfg(ps_shards=2, checkpoint_dir=str(tmp_path), checkpoint_every=1.0)
    store = persist.server_store(cfg)
    assert store is not None
    server = _TornServer([4, 5])
    history = tuple({"epoch": e, "loss": 1.0} for e in range(3))
    saver = persist.ServerCheckpointer(server, store, 1.0, lambda: 2, lambda at: history)  # type: ignore[arg-type]
    assert saver.maybe_save() is None and store.steps() == []
    server.versions = [5, 5]  # the next poll finds both shards at one step
    assert saver.maybe_save() == 5 and store.steps() == [5]


@pytest.mark.timeout(30)
def test_a_checkpoint_of_another_layout_is_refused(tmp_path):
    cfg = ps_cfg(ps_shards=2, checkpoint_dir=str(tmp_path))
    store = persist.server_store(cfg)
    assert store is not None
    with _start(cfg) as server:
        store.save(persist.to_checkpoint(server.state(), ()))
    other = TrainConfig(**{**cfg.to_dict(), "ps_shards": 3})
    with _start(other) as server, pytest.raises(Exception, match="same model, ps_shards"):
        persist.restore(store, server)
