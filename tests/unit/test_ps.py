"""The parameter server without Spark: shards served in this process, workers in threads."""

from __future__ import annotations

import itertools
import json
import socket
import threading
import time

import numpy as np
import pytest
import torch

from sparktrain.errors import CommError, ConfigError, HandshakeError, PeerLostError
from sparktrain.strategies.ps import protocol
from sparktrain.strategies.ps.client import ParameterServerSync, ShardClient, connect_shards
from sparktrain.strategies.ps.layout import shard_ranges
from sparktrain.strategies.ps.server import ParameterServer
from sparktrain.wire.frames import SHORT_HEADER_BYTES
from sparktrain.wire.handshake import DRIVER_RANK, connect
from sparktrain.wire.stats import CommStats

from .fixtures import (
    SECRET,
    ps_cfg,
    ps_server,
    ps_train,
    random_parts,
)


def _client(
    server: ParameterServer, rank: int = 0, attempt: int = 0, shard: int = 0, timeout: float = 5.0
):
    """A client of one shard (connected to all: a dropped connection means a lost rank)."""
    n = server.ranges[-1][1]
    clients = connect_shards(
        server.addresses,
        rank=rank,
        secret=SECRET,
        job_id="job",
        attempt=attempt,
        timeout=timeout,
        stats=CommStats(),
        num_elements=n,
        dtype=np.dtype(np.float32),
    )
    _KEEP.extend(clients)
    return clients[shard], np.zeros(n, np.float32)


_KEEP: list[ShardClient] = []


@pytest.fixture(autouse=True)
def _close_clients():
    yield
    for c in _KEEP:
        c.close()
    _KEEP.clear()


# ---------------------------------------------------------------------- layout


@pytest.mark.timeout(10)
def test_shards_are_balanced_by_bytes_and_cover_the_vector():
    ranges = shard_ranges(10, 3)
    assert ranges == [(0, 4), (4, 7), (7, 10)]
    for n, k in [(1, 1), (67, 4), (8906, 2), (1000, 7)]:
        rs = shard_ranges(n, k)
        sizes = [hi - lo for lo, hi in rs]
        assert max(sizes) - min(sizes) <= 1 and sum(sizes) == n and rs[0][0] == 0
        assert all(a[1] == b[0] for a, b in itertools.pairwise(rs))
    with pytest.raises(ConfigError, match="ps_shards=5 is more than the model's 4"):
        shard_ranges(4, 5)


@pytest.mark.timeout(10)
def test_too_many_shards_for_the_model_is_a_config_error():
    with pytest.raises(ConfigError, match="parameter elements"):
        ps_server(ps_cfg(ps_shards=10_000))


# ---------------------------------------------------------------------- training


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("sizes", "optimizer", "kwargs", "shards"),
    [
        ([13, 2], "sgd", {"momentum": 0.9}, 2),  # rank 1 has count 0 in most steps
        ([9, 7], "adam", {}, 3),
        ([6, 10], "sgd", {"weight_decay": 0.01, "nesterov": True, "momentum": 0.5}, 1),
    ],
)
def test_sync_ps_equals_the_ring(sizes, optimizer, kwargs, shards):
    common = {"optimizer": optimizer, "optimizer_kwargs": kwargs, "lr": 0.05}
    ring, _, _ = ps_train(ps_cfg(strategy="ring", **common), random_parts(sizes))
    ps, _, records = ps_train(
        ps_cfg(ps_shards=shards, ps_mode="sync", **common), random_parts(sizes)
    )
    for got, want in zip(ps.model.parameters(), ring.model.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    s = ps.summary["ps"]
    steps = 2 * ps.summary["steps_per_epoch"]
    assert s["mode"] == "sync" and s["shards"] == shards
    assert s["pushes"] == steps * len(sizes) * shards
    assert all(sh["version"] == steps for sh in s["per_shard"])
    assert s["duplicates"] == 0 and s["rejected"] == 0 and s["failure"] is None
    assert ps.summary["replicas_in_sync"]
    assert ps.summary["wire_bytes"] > ps.summary["bytes_sent"] > 0
    stats = [json.loads(r.data) for r in records if r.kind == "stats"]
    assert all(st["ps_steps"] == steps for st in stats)
    assert all(st["comm"]["wire_bytes_sent"] > 0 for st in stats)  # counted in mesh.stats


@pytest.mark.timeout(60)
def test_async_trains_and_records_staleness():
    parts = random_parts([40, 40])
    result, _, _ = ps_train(ps_cfg(ps_mode="async", epochs=3, lr=0.05), parts)
    s = result.summary["ps"]
    updates = sum(sh["updates"] for sh in s["per_shard"])
    assert sum(s["staleness_hist"].values()) == updates > 0
    assert s["mean_staleness"] >= 0 and s["failure"] is None
    assert result.history[-1]["loss"] < result.history[0]["loss"] * 1.5
    assert all(np.isfinite(p.detach().numpy()).all() for p in result.model.parameters())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bound", [0, 1, 3])
def test_ssp_never_exceeds_the_staleness_bound_with_a_slow_worker(monkeypatch, bound):
    original = ParameterServerSync.step

    def slowed(self, count):
        if self.rank == 1:
            time.sleep(0.01)  # test-only: rank 1 is the straggler
        original(self, count)

    monkeypatch.setattr(ParameterServerSync, "step", slowed)
    result, _, _ = ps_train(
        ps_cfg(ps_mode="ssp", staleness=bound, staleness_lr=True, epochs=2, batch_size=2),
        random_parts([30, 30]),
    )
    s = result.summary["ps"]
    assert s["staleness_bound"] == bound
    assert 0 <= s["max_ssp_gap"] <= bound
    assert s["pushes"] == 2 * 2 * 15 * 2  # ranks * epochs * steps * shards
    assert s["failure"] is None


# ---------------------------------------------------------------------- one shard, directly


@pytest.mark.timeout(20)
def test_a_duplicate_push_is_acknowledged_and_not_applied_twice():
    cfg = ps_cfg(ps_mode="async", ps_shards=1, lr=0.5)
    server = ps_server(cfg)
    try:
        client, flat = _client(server)
        client.pull(-1, flat)
        before = flat.copy()
        grad = np.ones_like(flat)
        assert client.push(0, 3, grad) == protocol.OK
        assert client.push(0, 3, grad) == protocol.DUPLICATE
        client.pull(0, flat)
        np.testing.assert_allclose(flat, before - 0.5, rtol=1e-6)  # one SGD step, not two
        s = server.stats()
        assert s["pushes"] == 1 and s["duplicates"] == 1 and s["per_shard"][0]["version"] == 1
        with pytest.raises(CommError, match="pushed step 5 after step 0"):
            client.push(5, 3, grad)
    finally:
        server.stop()


@pytest.mark.timeout(20)
def test_a_push_from_an_earlier_stage_attempt_is_rejected():
    cfg = ps_cfg(ps_mode="async", ps_shards=1)
    server = ps_server(cfg, attempt=1)
    try:
        # the handshake binds the attempt: an attempt-0 worker cannot even connect...
        with pytest.raises(HandshakeError, match="older attempt"):
            _client(server, attempt=0)
        # ...and a push whose header names attempt 0 is rejected on a current connection
        client, flat = _client(server, attempt=1)
        client.pull(-1, flat)
        with pytest.raises(CommError, match="earlier attempts are rejected"):
            client.push(0, 1, np.ones_like(flat), attempt=0)
        assert server.stats()["rejected"] == 1 and server.stats()["pushes"] == 0
        assert client.push(0, 1, np.ones_like(flat)) == protocol.OK  # the connection still works
    finally:
        server.stop()


@pytest.mark.timeout(20)
def test_a_wrong_secret_is_refused():
    server = ps_server(ps_cfg(ps_shards=2))
    try:
        with pytest.raises(HandshakeError):
            connect(
                server.addresses[1],
                secret=b"x" * 32,
                job_id="job",
                attempt=0,
                my_rank=0,
                peer_rank=DRIVER_RANK,
                timeout=5.0,
                stats=CommStats(),
            )
    finally:
        server.stop()


@pytest.mark.timeout(20)
def test_pulling_an_unchanged_shard_costs_a_header_only():
    cfg = ps_cfg(ps_mode="async", ps_shards=2)
    server = ps_server(cfg)
    try:
        client, flat = _client(server, shard=1)
        part = flat[client.lo : client.hi]
        assert client.pull(-1, part) == protocol.FULL
        stats = client.conn.stats
        before = stats.as_dict()
        assert client.pull(-1, part) == protocol.UNCHANGED
        after = stats.as_dict()
        assert (
            after["wire_bytes_recv"] - before["wire_bytes_recv"]
            == SHORT_HEADER_BYTES + protocol.REPLY.size  # a 1-D frame: the short header
        )
        # after an update, the delta brings the copy to the server's values exactly
        client.push(0, 2, np.full_like(part, 0.25))
        assert client.pull(0, part) == protocol.DELTA
        np.testing.assert_array_equal(part, server.parameters()[client.lo : client.hi])
    finally:
        server.stop()


@pytest.mark.timeout(20)
def test_stop_is_prompt_and_leaves_nothing_listening():
    # the server's timeout outlasts the test: a stop that waited for it would time out
    server = ps_server(ps_cfg(ps_mode="sync", ps_shards=3, comm_timeout=600.0), world=2)
    client, flat = _client(server)
    client.pull(-1, flat[client.lo : client.hi])
    client.push(0, 1, np.ones(client.hi - client.lo, np.float32))
    waiting: list[BaseException] = []

    def pull() -> None:  # blocks: rank 1 never pushes step 0
        try:
            client.pull(0, flat[client.lo : client.hi])
        except BaseException as exc:
            waiting.append(exc)

    t = threading.Thread(target=pull)
    t.start()
    time.sleep(0.2)  # the pull is very likely waiting at the server by now
    server.stop()
    server.stop()  # idempotent
    t.join()  # the client dials again until its own 5 s timeout: nothing listens
    assert len(waiting) == 1 and isinstance(waiting[0], CommError), waiting
    for address in server.addresses:
        host, port = address.rsplit(":", 1)
        with socket.socket() as s, pytest.raises(ConnectionRefusedError):
            s.connect((host, int(port)))
    alive = [t.name for t in threading.enumerate() if t.name.startswith("sparktrain-ps-")]
    assert not alive


@pytest.mark.timeout(20)
def test_a_worker_that_disconnects_fails_the_others_naming_it():
    server = ps_server(ps_cfg(ps_mode="sync", ps_shards=2, comm_timeout=30.0), world=2)
    try:
        c0, flat = _client(server, rank=0, timeout=600.0)
        c1, _ = _client(server, rank=1)
        c0.pull(-1, flat[c0.lo : c0.hi])
        c0.push(0, 1, np.ones(c0.hi - c0.lo, np.float32))
        c1.close()  # rank 1 dies without a goodbye
        # named by the server once rank 1's reconnect grace is over: the server's timeout
        # and rank 0's own both outlast the test, so nothing else can end the pull
        with pytest.raises(PeerLostError, match="lost contact with rank 1") as info:
            c0.pull(0, flat[c0.lo : c0.hi])
        assert info.value.rank == 1
        assert server.stats()["failure"]["rank"] == 1
    finally:
        server.stop()


@pytest.mark.timeout(20)
def test_a_silent_worker_is_named_after_comm_timeout():
    server = ps_server(ps_cfg(ps_mode="sync", ps_shards=1, comm_timeout=1.0), world=2)
    try:
        c0, flat = _client(server, rank=0)
        c0.pull(-1, flat)
        c0.push(0, 1, np.ones_like(flat))
        with pytest.raises(PeerLostError, match="did not push step 0 within comm_timeout") as info:
            c0.pull(0, flat)  # rank 1 never connects
        assert info.value.rank == 1
    finally:
        server.stop()


@pytest.mark.timeout(20)
def test_a_new_stage_attempt_continues_from_the_servers_parameters():
    cfg = ps_cfg(ps_mode="sync", ps_shards=2)
    server = ps_server(cfg, world=1)
    try:
        c0, flat = _client(server)
        c0.pull(-1, flat[c0.lo : c0.hi])
        c0.push(0, 1, np.ones(c0.hi - c0.lo, np.float32))
        c1 = _KEEP[-1]  # the same rank's connection to shard 1
        c1.push(0, 1, np.ones(c1.hi - c1.lo, np.float32))
        c0.pull(0, flat[c0.lo : c0.hi])
        trained = server.parameters()
        server.begin_attempt(1)
        with pytest.raises(CommError):  # the old attempt's connection was closed
            c0.push(1, 1, np.ones(c0.hi - c0.lo, np.float32))
        fresh, flat1 = _client(server, attempt=1)
        assert fresh.pull(-1, flat1[fresh.lo : fresh.hi]) == protocol.FULL
        np.testing.assert_array_equal(flat1[fresh.lo : fresh.hi], trained[fresh.lo : fresh.hi])
        # the global step count continues: step 0 was applied, step 1 is the next one
        assert fresh.push(0, 1, np.zeros(fresh.hi - fresh.lo, np.float32)) == protocol.DUPLICATE
        assert fresh.push(1, 1, np.zeros(fresh.hi - fresh.lo, np.float32)) == protocol.OK
        assert server.stats()["failure"] is None
    finally:
        server.stop()


@pytest.mark.timeout(60)
def test_a_schedule_with_warmup_drives_the_servers_rate_as_the_rings():
    common = {
        "optimizer": "sgd",
        "optimizer_kwargs": {"momentum": 0.9},
        "lr": 0.1,
        "lr_schedule": "CosineAnnealingLR",
        "warmup_steps": 3,
    }
    ring, _, _ = ps_train(ps_cfg(strategy="ring", **common), random_parts([9, 7]))
    ps, _, _ = ps_train(ps_cfg(ps_shards=2, ps_mode="sync", **common), random_parts([9, 7]))
    for got, want in zip(ps.model.parameters(), ring.model.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert [h["lr"] for h in ps.history] == [h["lr"] for h in ring.history]
