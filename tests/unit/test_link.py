"""Link emulation (wire/link.py): the model on a virtual clock, then the connections
that apply it, over real loopback but on a virtual clock too: every test checks the
holds and sleeps the model asks for, exact figures, never how long anything took (a
shared, loaded machine stretches those at random). How close the emulation comes to a
kernel-shaped link in wall-clock time is a benchmark's question: ``python -m benchmarks
multihost --parts compare`` (own emulation against ``tc tbf``).
"""

from __future__ import annotations

import itertools
import math
import sys
import threading
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from sparktrain.config import LINK_PROFILES, TrainConfig
from sparktrain.errors import ConfigError, PeerLostError
from sparktrain.wire import (
    KIND_CONTROL,
    CommStats,
    Connection,
    Mesh,
    RingAllreduce,
)
from sparktrain.wire import connection as connection_module
from sparktrain.wire import link as link_module
from sparktrain.wire.frames import HEADER_BYTES, SHORT_HEADER_BYTES, SHORT_STAMP
from sparktrain.wire.link import (
    DEFAULT_BURST_BYTES,
    MBIT,
    PACKET_BYTES,
    PROFILES,
    LinkProfile,
    LinkShaper,
    emulate_task_transfer,
    emulate_transfer,
    link_from_config,
    link_profile,
)

from . import fixtures

pytestmark = pytest.mark.timeout(60)

HEADER = SHORT_HEADER_BYTES + SHORT_STAMP.size
"""The header of a stamped 1-D frame (the short form and its stamp: wire/frames.py)."""


def _pair(
    client_link: LinkProfile | None, server_link: LinkProfile | None = None, timeout: float = 5.0
) -> tuple[Connection, Connection]:
    """(client, server) over real loopback; each side shapes its own sends."""
    client, server = fixtures.pair(
        timeout, client_kw={"link": client_link}, server_kw={"link": server_link}
    )
    assert isinstance(client, Connection), client
    assert isinstance(server, Connection), server
    return client, server


def _in_thread(fn: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []

    def body() -> None:
        try:
            out.append(fn())
        except BaseException as exc:
            out.append(exc)

    t = threading.Thread(target=body, daemon=True)
    t.start()
    return t, out


# ------------------------------------------------------------------ profiles and config


def test_every_config_profile_exists_with_documented_figures() -> None:
    assert set(PROFILES) == set(LINK_PROFILES)
    assert PROFILES["none"].unshaped
    five_g = PROFILES["5g"]
    assert five_g.bandwidth == pytest.approx(100 * MBIT)  # 100 Mbit/s = 12.5 MB/s
    assert five_g.rtt == pytest.approx(0.020)
    for name in ("lan", "5g", "4g", "wan"):
        p = PROFILES[name]
        assert not p.unshaped and p.loss == 0 and p.jitter <= p.rtt / 2
        assert name in p.describe()
    assert PROFILES["lan"].bandwidth > PROFILES["wan"].bandwidth > PROFILES["4g"].bandwidth
    assert PROFILES["lan"].rtt < PROFILES["5g"].rtt < PROFILES["4g"].rtt < PROFILES["wan"].rtt


def test_link_from_config_profiles_and_overrides() -> None:
    assert link_from_config(TrainConfig()) is None  # default: unshaped
    assert link_from_config(TrainConfig.from_dict({"link": "none"})) is None
    five_g = link_from_config(TrainConfig.from_dict({"link": "5g", "seed": 7}))
    assert five_g is not None and five_g.name == "5g" and five_g.seed == 7
    assert (five_g.bandwidth, five_g.rtt) == (PROFILES["5g"].bandwidth, PROFILES["5g"].rtt)
    custom = link_from_config(
        TrainConfig.from_dict(
            {"link": {"profile": "wan", "bandwidth_mbit": 10, "jitter_ms": 1, "loss": 0.01}}
        )
    )
    assert custom is not None and custom.name == "wan+custom"
    assert custom.bandwidth == pytest.approx(1.25e6)
    assert custom.rtt == PROFILES["wan"].rtt  # 0 keeps the profile's figure
    assert (custom.jitter, custom.loss) == (pytest.approx(0.001), 0.01)
    # "none" plus explicit figures: only what was asked for
    delay_only = link_from_config(TrainConfig.from_dict({"link": {"rtt_ms": 50}}))
    assert delay_only is not None and math.isinf(delay_only.bandwidth)
    assert delay_only.rtt == pytest.approx(0.05)
    rate_only = link_profile("none", bandwidth_mbit=80)
    assert rate_only is not None and rate_only.bandwidth == pytest.approx(10e6)
    assert rate_only.rtt == 0


def test_bad_link_input_says_what_to_do() -> None:
    with pytest.raises(ConfigError, match="unknown link profile '6g'.*5g"):
        link_profile("6g")
    with pytest.raises(ConfigError, match="rtt_ms"):
        link_profile("5g", rtt_ms=-1)
    with pytest.raises(ConfigError, match="bandwidth must be > 0"):
        LinkProfile("x", 0.0, 0.01)
    with pytest.raises(ConfigError, match="loss must be a probability"):
        LinkProfile("x", 1e6, 0.01, loss=1.0)
    with pytest.raises(ConfigError, match="jitter"):
        LinkProfile("x", 1e6, 0.01, jitter=math.nan)
    with pytest.raises(ConfigError, match="link.profile"):
        TrainConfig.from_dict({"link": "6g"})
    with pytest.raises(ValueError, match="size >= 0"):
        emulate_transfer(PROFILES["5g"], -1)


# ------------------------------------------------------------------ the model, fake clock


def test_token_bucket_and_overlapped_delay_on_a_virtual_clock() -> None:
    p = LinkProfile("t", 1e6, 0.1)  # 1 MB/s, 50 ms one way
    shaper = LinkShaper(p)
    first = shaper.book(1000, now=0.0)
    assert first.due == pytest.approx(0.001 + 0.05)
    assert first.release == 0.0  # within the burst: the sender goes on at once
    # 100 frames of 10 kB back to back: the link serialises them, delays overlap.
    bookings = [shaper.book(10_000, now=0.0) for _ in range(100)]
    assert bookings[-1].due == pytest.approx(0.001 + 1.0 + 0.05)
    assert bookings[-1].release == pytest.approx(1.001 - DEFAULT_BURST_BYTES / 1e6)
    assert all(a.due < b.due for a, b in itertools.pairwise(bookings))
    # After an idle gap the link starts afresh.
    late = shaper.book(10_000, now=5.0)
    assert late.due == pytest.approx(5.0 + 0.01 + 0.05)
    assert shaper.as_dict()["frames"] == 102 and shaper.bytes == 1000 + 101 * 10_000


def test_jitter_stays_within_bounds_and_order_is_kept() -> None:
    p = LinkProfile("t", math.inf, 0.04, jitter=0.01)  # one way 20 ms ± 10 ms
    spaced = LinkShaper(p, seed=1)
    delays = np.array([spaced.book(100, now=float(i)).due - i for i in range(2000)])
    assert delays.min() >= 0.010 and delays.max() <= 0.030
    assert delays.mean() == pytest.approx(0.020, abs=0.001)
    assert delays.max() - delays.min() > 0.018  # it does vary, over the whole range
    # Frames closer together than the jitter: never delivered out of order.
    tight = LinkShaper(p, seed=2)
    dues = [tight.book(100, now=i * 0.001).due for i in range(500)]
    assert dues == sorted(dues)
    assert max(d - i * 0.001 for i, d in enumerate(dues)) <= 0.030 + 1e-9
    # Seeded: the same draws again.
    again = LinkShaper(p, seed=1)
    assert again.book(100, now=0.0).due - 0.0 == pytest.approx(delays[0])


def test_loss_costs_a_round_trip_per_lost_packet() -> None:
    p = LinkProfile("t", 10e6, 0.02, loss=0.01)
    nbytes = 10_000_000
    packets = math.ceil(nbytes / PACKET_BYTES)
    mean, sigma = packets * 0.01, math.sqrt(packets * 0.01 * 0.99)
    for seed in range(5):
        shaper = LinkShaper(p, seed=seed)
        booking = shaper.book(nbytes, now=0.0)
        lost = shaper.lost_packets
        assert abs(lost - mean) < 5 * sigma
        assert booking.due == pytest.approx(1.0 + lost * 0.02 + 0.01)
    assert p.transfer_s(nbytes) == pytest.approx(1.0 + mean * 0.02 + 0.01)
    assert p.max_lost(nbytes) < packets and p.max_lost(nbytes) > mean + 5 * sigma
    assert LinkProfile("t", 10e6, 0.02).max_lost(nbytes) == 0


# ------------------------------------------------------------------ connections, virtual clock
#
# The connections apply the model through their modules' ``time`` (wire/connection.py,
# wire/link.py) and wait out each hold on their close event. The tests below replace both:
# the clock stands still unless a test moves it, and every hold a connection asks for is
# recorded (and returns at once), so what the link makes a sender or a receiver wait is
# an exact figure, however loaded the machine. The bytes still cross real loopback.


class VirtualTime:
    """A clock that stands still unless :meth:`sleep` or a test moves ``now``
    (``monotonic``, ``perf_counter`` and ``time_ns`` agree); ``sleeps`` records every
    sleep asked for."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    perf_counter = monotonic

    def time_ns(self) -> int:
        return round(self.now * 1e9)

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


class Holds(threading.Event):
    """A connection's close event that records every hold the connection waits on it for
    (``holds``, seconds) and sets ``holding`` when one starts. ``real``: the hold waits
    until the connection closes (or its time passes), else it returns at once."""

    def __init__(self, real: bool) -> None:
        super().__init__()
        self.real = real
        self.holds: list[float] = []
        self.holding = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.holds.append(math.inf if timeout is None else timeout)
        self.holding.set()
        return super().wait(timeout) if self.real else self.is_set()


def _record_holds(monkeypatch: pytest.MonkeyPatch, real: bool) -> None:
    """Connections made from now on get a :class:`Holds` as their close event."""
    shim = SimpleNamespace(Lock=threading.Lock, Event=lambda: Holds(real))
    monkeypatch.setattr(connection_module, "threading", shim)


def _closing(conn: Connection) -> Holds:
    closing = conn._closing
    assert isinstance(closing, Holds), closing
    return closing


def holds(conn: Connection) -> list[float]:
    """Every hold ``conn`` asked for: its sends held by the bandwidth, its receives held
    until the frame was due."""
    return _closing(conn).holds


@pytest.fixture
def virtual(monkeypatch: pytest.MonkeyPatch) -> VirtualTime:
    clock = VirtualTime()
    fake_time = SimpleNamespace(
        monotonic=clock.monotonic,
        perf_counter=clock.perf_counter,
        time_ns=clock.time_ns,
        sleep=clock.sleep,
    )
    monkeypatch.setattr(connection_module, "time", fake_time)
    monkeypatch.setattr(link_module, "time", fake_time)
    _record_holds(monkeypatch, real=False)
    return clock


@pytest.mark.parametrize("frame_bytes", [1 << 20, 10_000_000], ids=["1MiB-frames", "one-frame"])
def test_10MB_at_10MB_per_s_takes_one_second(frame_bytes: int, virtual: VirtualTime) -> None:
    """The issue's acceptance test: an emulated 10 MB/s (80 Mbit/s) link makes a 10 MB
    transfer take 1 s, in 1 MiB frames or as one frame: the receiver holds the last frame
    until 1 s after the first was sent, and the sender is held until its last bytes are
    within a burst of the link."""
    link = link_profile("none", bandwidth_mbit=80)
    assert link is not None and link.bandwidth == pytest.approx(10e6)
    client, server = _pair(link, link)
    data = np.arange(10_000_000, dtype=np.uint8)
    out = np.zeros_like(data)
    starts = range(0, data.size, frame_bytes)
    try:

        def send() -> None:
            for a in starts:
                client.send_array(data[a : a + frame_bytes])

        t, sent = _in_thread(send)
        for a in starts:
            server.recv_into(out[a : a + frame_bytes])
        t.join()
    finally:
        client.close()
        server.close()
    assert sent == [None], sent
    np.testing.assert_array_equal(out, data)
    assert client.stats.wire_bytes_sent >= 10_000_000  # bytes are counted as before
    on_the_wire = np.cumsum([min(frame_bytes, data.size - a) + HEADER for a in starts])
    # each frame arrives once the link has carried it and every frame before it
    assert holds(server) == pytest.approx(list(on_the_wire / 10e6))
    assert holds(server)[-1] == pytest.approx(1.0, rel=1e-4)
    # the sender is held by the bandwidth too: until its last frame is a burst from done
    burst_s = DEFAULT_BURST_BYTES / 10e6
    assert holds(client)[-1] == pytest.approx(on_the_wire[-1] / 10e6 - burst_s)


def test_ping_pong_takes_one_rtt(virtual: VirtualTime) -> None:
    link = link_profile("none", rtt_ms=60)
    assert link is not None
    client, server = _pair(link, link)
    ping = np.zeros(16, dtype=np.float32)
    rounds = 5
    try:

        def echo() -> None:
            buf = np.empty_like(ping)
            for _ in range(rounds):
                server.recv_into(buf)
                server.send_array(buf)

        t, out = _in_thread(echo)
        for _ in range(rounds):
            client.send_array(ping)
            client.recv_into(ping)
        t.join()
    finally:
        client.close()
        server.close()
    assert out == [None], out
    # each way holds half the RTT (no bandwidth limit: no sender is ever held)
    assert holds(server) == pytest.approx([0.030] * rounds)
    assert holds(client) == pytest.approx([0.030] * rounds)
    for there, back in zip(holds(server), holds(client), strict=True):
        assert there + back == pytest.approx(link.rtt)


def test_back_to_back_frames_overlap_their_delays(virtual: VirtualTime) -> None:
    """40 frames of 32 KiB on a 10 MB/s link with a 100 ms one-way delay arrive in
    about 40 * 32 KiB / 10 MB/s + 100 ms = 0.23 s, not 40 * 100 ms = 4 s."""
    link = link_profile("none", bandwidth_mbit=80, rtt_ms=200)
    client, server = _pair(link, link)
    frame = np.ones(32 << 10, dtype=np.uint8)
    n = 40
    try:

        def send() -> None:
            for _ in range(n):
                client.send_array(frame)

        t, _ = _in_thread(send)
        buf = np.empty_like(frame)
        for _ in range(n):
            server.recv_into(buf)
        t.join()
    finally:
        client.close()
        server.close()
    per_frame = (frame.nbytes + HEADER) / 10e6
    assert holds(server) == pytest.approx([(k + 1) * per_frame + 0.1 for k in range(n)])
    assert holds(server)[0] >= 0.1
    assert holds(server)[-1] == pytest.approx(n * per_frame + 0.1)  # 0.23 s
    assert holds(server)[-1] < n * 0.1 / 10  # serialised delays would be 4 s


def test_jitter_on_a_live_connection_within_bounds(virtual: VirtualTime) -> None:
    link = link_profile("none", rtt_ms=40, jitter_ms=10)  # one way 20 ± 10 ms
    client, server = _pair(link, link)
    n = 25
    buf = np.zeros(1, dtype=np.float64)
    try:
        for _ in range(n):
            client.send_array(buf)
            server.recv_into(buf)
            virtual.now += 1.0  # frames far apart: each one's delay is its own draw
    finally:
        client.close()
        server.close()
    delays = np.array(holds(server))  # one way: 20 ms ± 10 ms, each frame its own draw
    assert len(delays) == n and holds(client) == []  # no bandwidth limit: senders go on
    assert delays.min() >= 0.010 - 1e-9 and delays.max() <= 0.030 + 1e-9
    assert delays.max() - delays.min() >= 0.005  # the delay varies


def test_unshaped_links_add_nothing(virtual: VirtualTime) -> None:
    assert link_profile("none") is None
    client, server = _pair(None, None)
    assert client.shaper is None and server.shaper is None
    same = _pair(PROFILES["none"], PROFILES["none"])  # an unshaped profile: no shaper
    assert same[0].shaper is None and same[1].shaper is None
    buf = np.zeros(1 << 20, dtype=np.uint8)
    try:
        for a, b in ((client, server), (server, client), same, same[::-1]):
            t, out = _in_thread(lambda a=a: a.send_array(buf))
            b.recv_into(buf)
            t.join()
            assert out == [None], out
    finally:
        for c in (client, server, *same):
            c.close()
    assert [holds(c) for c in (client, server, *same)] == [[], [], [], []]  # nothing held
    assert emulate_transfer(None, 10**9) == 0.0
    assert emulate_task_transfer(TrainConfig(), 10**9, 0, 0) == 0.0
    assert virtual.sleeps == []


def test_eight_dim_arrays_and_bytes_cross_a_shaped_link(virtual: VirtualTime) -> None:
    link = link_profile("none", rtt_ms=10)
    client, server = _pair(link, link)
    arr = np.arange(2**8, dtype=np.int32).reshape((2,) * 8)
    try:
        client.send_array(arr)
        out = np.empty(arr.size, dtype=np.int32)
        server.recv_into(out)
        np.testing.assert_array_equal(out, arr.reshape(-1))
        server.send_bytes(b"hello", KIND_CONTROL)
        assert client.recv_bytes(KIND_CONTROL) == (KIND_CONTROL, b"hello")
    finally:
        client.close()
        server.close()
    # the 8-dimensional frame's stamp took no shape slot: both frames were held 5 ms
    assert holds(server) == pytest.approx([0.005])
    assert holds(client) == pytest.approx([0.005])  # it held the reply


def test_close_wakes_a_receiver_holding_a_frame_and_a_held_sender(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Holds of an hour (real ones, this time): only close() can end them before the
    test's timeout."""
    _record_holds(monkeypatch, real=True)
    hour = link_profile("none", rtt_ms=7_200_000)  # one way 1 h
    client, server = _pair(hour, hour)  # a receiver without a link would not hold it
    client.send_array(np.zeros(4, dtype=np.float32))
    t, out = _in_thread(lambda: server.recv_into(np.empty(4, dtype=np.float32)))
    _closing(server).holding.wait()
    assert holds(server)[0] > 3000  # it holds the frame for the hour
    server.close()
    t.join()
    assert len(out) == 1 and isinstance(out[0], PeerLostError), out
    assert "holding a frame on the emulated link" in str(out[0])
    client.close()

    narrow = link_profile("none", bandwidth_mbit=0.004)  # 500 B/s: a 2 MB frame holds 4000 s
    client, server = _pair(narrow, narrow)
    reader, _ = _in_thread(lambda: server.recv_into(np.empty(2_000_000, dtype=np.uint8)))
    t, out = _in_thread(lambda: client.send_array(np.zeros(2_000_000, dtype=np.uint8)))
    _closing(client).holding.wait()
    assert holds(client)[0] > 3000  # the sender is held by the bandwidth
    client.close()
    t.join()
    assert out == [None], out  # the bytes had gone out: the send returns
    server.close()  # the reader holds the frame until it is due: wake it too
    reader.join()


def test_a_stamp_far_ahead_is_held_no_longer_than_the_timeout(virtual: VirtualTime) -> None:
    """A receiver whose own link is fast (or a skewed clock) never waits past its bound
    (the timeout plus its own profile's worst case); one without a link does not wait."""
    slow = link_profile("none", rtt_ms=20_000)  # stamps 10 s ahead
    fast = link_profile("none", rtt_ms=1)
    assert fast is not None
    timeout = 2.0
    for receiver_link in (fast, None):
        client, server = _pair(slow, receiver_link, timeout=timeout)
        try:
            client.send_array(np.zeros(4, dtype=np.float32))
            server.recv_into(np.empty(4, dtype=np.float32))
        finally:
            client.close()
            server.close()
        if receiver_link is None:
            assert holds(server) == []
        else:
            bound = timeout + fast.max_delivery_s(HEADER_BYTES + 16)  # the long form bounds it
            assert holds(server) == pytest.approx([bound]) and bound < 10.0


def test_ring_allreduce_over_an_emulated_link(virtual: VirtualTime) -> None:
    """3 ranks, 4 MiB of float32 each, 10 MB/s links with 10 ms RTT: every rank sends
    2 (n - 1) / n of the buffer, 5.6 MB, across its link, so its successor holds the
    last frame until 0.56 s plus a one-way delay after the first; the sums stay exact."""
    world, n = 3, 1 << 20
    link = link_profile("none", bandwidth_mbit=80, rtt_ms=10)
    assert link is not None
    inputs = [np.random.default_rng(r).standard_normal(n).astype(np.float32) for r in range(world)]

    def body(rank: int, mesh: Mesh) -> tuple[np.ndarray, int, list[float]]:
        buf = inputs[rank].copy()
        ring = RingAllreduce(mesh)
        mesh.connect_all([(rank + 1) % world, (rank - 1) % world])
        ring.allreduce_(buf)
        shaper = mesh.connection((rank + 1) % world).shaper
        assert shaper is not None
        return buf, shaper.bytes, holds(mesh.connection((rank - 1) % world))

    results = fixtures.run_mesh_ranks(world, body, timeout=10.0, link=link)
    fixtures.raise_first(results)
    expected = np.sum(inputs, axis=0, dtype=np.float32)
    for buf, _, _ in results:
        np.testing.assert_allclose(buf, expected, rtol=1e-5, atol=1e-5)
    for rank, (_, _, received) in enumerate(results):
        sent = results[(rank - 1) % world][1]  # by the predecessor, over this rank's link
        assert sent >= 2 * (world - 1) / world * n * 4
        assert max(received) == pytest.approx(sent / link.bandwidth + link.one_way_delay)
        assert max(received) == pytest.approx(0.565, abs=0.01)


def test_emulate_transfer_sleeps_the_modelled_time(virtual: VirtualTime) -> None:
    p = LinkProfile("t", 10e6, 0.04)
    slept = emulate_transfer(p, 1_000_000)
    assert slept == pytest.approx(0.1 + 0.02)
    assert virtual.sleeps == [slept]  # it slept what it says, once
    jittery = LinkProfile("t", 10e6, 0.04, jitter=0.01, loss=0.001)
    draws = [jittery.transfer_s(1_000_000, np.random.default_rng(s)) for s in range(50)]
    assert min(draws) >= 0.1 + 0.01 and max(draws) <= 0.1 + 0.03 + jittery.max_lost(10**6) * 0.04
    cfg = TrainConfig.from_dict({"link": {"rtt_ms": 20}, "seed": -3})  # negative seeds are fine
    assert emulate_task_transfer(cfg, 0, 1, 2, 0) == pytest.approx(0.01)
    assert emulate_transfer(p, 10**12, max_seconds=5.0) == 5.0  # capped
    assert virtual.sleeps[-1] == 5.0


def test_stats_count_bytes_as_before() -> None:
    link = link_profile("none", bandwidth_mbit=800)
    client, server = _pair(link, link)
    try:
        client.send_array(np.zeros(1000, dtype=np.float32))
        server.recv_into(np.empty(1000, dtype=np.float32))
    finally:
        client.close()
        server.close()
    stats: CommStats = client.stats
    assert stats.raw_bytes_sent == 4000 and stats.frames_sent == 1
    assert client.shaper is not None and client.shaper.bytes == 4000 + HEADER


# ------------------------------------------------------------------ tree_aggregate tasks


def test_tree_aggregate_tasks_pay_the_link_outside_their_compute_time(
    virtual: VirtualTime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A partition's round downloads the weights and uploads its payload over the
    emulated link (one one-way delay each way with rtt 200 ms), outside ``COMPUTE_S``:
    on a clock that only the link's sleeps move, the round's compute time stays 0."""
    import functools

    import torch

    from sparktrain.data.partition_data import PartitionData
    from sparktrain.models import mlp
    from sparktrain.result import state_to_bytes
    from sparktrain.strategies.tree_aggregate.codec import COMPUTE_S
    from sparktrain.strategies.tree_aggregate.flat import flatten
    from sparktrain.strategies.tree_aggregate.task import Block, RoundSpec, partition_round

    torch.manual_seed(0)
    model = mlp(6, (5,), 3)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 6)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.float64)
    block = Block(
        0, PartitionData(x, y, np.zeros(16, bool)), PartitionData(x, y, np.ones(16, bool))
    )
    weights = flatten(list(model.parameters()))
    # the task times its compute on the virtual clock too
    task_time = SimpleNamespace(perf_counter=virtual.perf_counter)
    monkeypatch.setattr(sys.modules[partition_round.__module__], "time", task_time)
    slept = {}
    for rtt_ms in (0.0, 200.0):
        cfg = TrainConfig(
            strategy="tree_aggregate", batch_size=8, progress=False, link_rtt_ms=rtt_ms
        )
        spec = RoundSpec(f"link-{rtt_ms}", cfg, state_to_bytes(model.state_dict()), 2, True,
                         model_fn=functools.partial(mlp, 6, (5,), 3))  # fmt: skip
        before = len(virtual.sleeps)
        payload, stats = partition_round(spec, weights, block, 0)
        assert payload is not None
        assert float(stats[COMPUTE_S]) == 0.0  # the link's sleeps are outside COMPUTE_S
        slept[rtt_ms] = virtual.sleeps[before:]
    assert slept[0.0] == []  # no link, no sleep
    # the weights' download, then the payload's upload: one one-way delay each
    assert slept[200.0] == pytest.approx([0.1, 0.1])
