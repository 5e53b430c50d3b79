"""Link emulation: make loopback behave like a 5G, 4G, WAN or LAN link, without root.

The ``link`` option of :class:`~sparktrain.config.TrainConfig` shapes sparktrain's own
transport (:mod:`sparktrain.wire.connection`) instead of the kernel's, so it needs neither
root nor ``tc``. Each direction of each connection gets a :class:`LinkShaper`; the model is
the one ``tc netem`` + a rate limit would apply to a TCP stream:

* **Bandwidth** -- a token bucket, written as a virtual clock (GCRA): a frame of ``n``
  wire bytes (header included: 24 bytes for a stamped 1-D frame, else 88) occupies the link from
  ``start = max(now, link free)`` to ``finish = start + n / bandwidth``. The sender's
  ``send`` returns at ``finish - burst / bandwidth`` (``burst`` = 64 KiB by default), as
  a socket whose buffer is small returns once the bytes are on the wire. TCP/IP headers
  are not counted, so a kernel-shaped link of the same rate (``tc tbf``) is a few per cent
  slower at MTU 1500 (``python -m benchmarks multihost --parts compare`` measures both).
* **Latency** -- the frame is *delivered* at ``due = finish + one-way delay``, one-way
  delay = ``rtt / 2`` plus jitter drawn uniformly from ``[-jitter, +jitter]`` (netem's
  default distribution), never below 0. Frames stay in order (TCP re-sequences what
  netem reorders): ``due`` is never earlier than the previous frame's. The delay is not
  served by the sender: the bytes are written to the socket at once with ``due`` stamped
  in the frame header, and the *receiver* holds the frame until ``due``. So frames sent
  back to back overlap their delays, as packets in flight do -- ``k`` frames take
  ``k * n / bandwidth + delay``, not ``k * (n / bandwidth + delay)`` -- and since the
  bytes are already in the receiver's socket buffer, no socket timeout can fire while
  a slow link "carries" them.
* **Loss** -- each 1500-byte packet is lost with probability ``loss`` (netem's
  per-packet loss); each lost packet costs one round trip during which the direction
  carries nothing else (a fast retransmit). This is optimistic for TCP: congestion-window
  halving and retransmission timeouts are not modelled.

The stamp is a wall-clock time (``time.time_ns``) because sender and receiver are
different processes: emulation assumes both ends share a clock, i.e. one host (every
loopback run) or hosts whose clocks agree to well under the emulated delay. A receiver
never holds a frame longer than its comm timeout plus the frame's own worst case under
its profile, so a skewed or bogus stamp cannot hang it.

What is not modelled: the handshake and abort notices (sent unshaped, once per
connection); a node's shared uplink (each connection is its own link, as if every pair
of processes had its own path; a parameter-server shard talking to N workers has N
links); asymmetric up/down rates; the metrics channel (never shaped). For
``tree_aggregate``, whose bytes move on Spark's own sockets, the link is modelled per
task with :func:`emulate_task_transfer`: each partition's task, every round, sleeps as
long as receiving the broadcast weights and sending back its payload would take (outside
its compute time); the tree's intermediate combine levels are not shaped.

Executor-side code: this module never imports pyspark.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from sparktrain.errors import ConfigError

MBIT = 1e6 / 8
"""Bytes per second in one Mbit/s."""

PACKET_BYTES = 1500
"""The packet size loss is drawn per (an Ethernet MTU, as netem sees a TCP stream)."""

DEFAULT_BURST_BYTES = 64 << 10
"""Token-bucket depth: how far (in bytes) a sender may run ahead of the link."""

CLOCK_SLACK_S = 0.25
"""Extra hold a receiver tolerates beyond a frame's modelled worst case (clock skew)."""

_LOSS_SIGMAS = 6.0  # lost packets per frame are capped at mean + 6 sigma + 1


@dataclass(frozen=True)
class LinkProfile:
    """The figures of an emulated link (the same in both directions).

    ``bandwidth`` is in bytes per second (``math.inf``: no rate limit), ``rtt`` and
    ``jitter`` in seconds (the one-way delay is ``rtt / 2 ± jitter``), ``loss`` the
    probability a 1500-byte packet is lost (each loss costs one ``rtt``). ``seed`` seeds
    the jitter and loss draws (each connection direction mixes in its ranks).
    """

    name: str
    bandwidth: float
    rtt: float
    jitter: float = 0.0
    loss: float = 0.0
    burst_bytes: int = DEFAULT_BURST_BYTES
    seed: int = 0

    def __post_init__(self) -> None:
        if not (isinstance(self.bandwidth, int | float) and self.bandwidth > 0):
            raise ConfigError(
                f"link bandwidth must be > 0 bytes/s (math.inf for no limit), got "
                f"{self.bandwidth!r}"
            )
        for key in ("rtt", "jitter"):
            value = getattr(self, key)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ConfigError(
                    f"link {key} must be a finite number of seconds >= 0, got {value!r}"
                )
        if not (isinstance(self.loss, int | float) and 0.0 <= self.loss < 1.0):
            raise ConfigError(f"link loss must be a probability in [0, 1), got {self.loss!r}")
        if not (isinstance(self.burst_bytes, int) and self.burst_bytes >= 0):
            raise ConfigError(f"link burst_bytes must be an integer >= 0, got {self.burst_bytes!r}")

    @property
    def unshaped(self) -> bool:
        """True when the profile changes nothing (no rate limit, delay, jitter or loss)."""
        return math.isinf(self.bandwidth) and self.rtt == 0 and self.jitter == 0 and self.loss == 0

    @property
    def one_way_delay(self) -> float:
        """The mean one-way delay in seconds (``rtt / 2``; jitter averages out)."""
        return self.rtt / 2

    def serialisation_s(self, nbytes: int) -> float:
        """Seconds ``nbytes`` occupy the link at its bandwidth."""
        return 0.0 if math.isinf(self.bandwidth) else nbytes / self.bandwidth

    def packets(self, nbytes: int) -> int:
        """The number of packets ``nbytes`` travel in (for loss)."""
        return max(1, -(-nbytes // PACKET_BYTES))

    def max_lost(self, nbytes: int) -> int:
        """Cap on the packets of one ``nbytes`` transfer counted lost (mean + 6 sigma + 1),
        shared by sender and receiver so the receiver can bound an honest stamp."""
        if self.loss == 0:
            return 0
        n, p = self.packets(nbytes), self.loss
        return min(n, math.ceil(n * p + _LOSS_SIGMAS * math.sqrt(n * p * (1 - p))) + 1)

    def draw_lost(self, nbytes: int, rng: np.random.Generator) -> int:
        """How many packets of an ``nbytes`` transfer are lost (binomial, capped)."""
        if self.loss == 0:
            return 0
        return min(int(rng.binomial(self.packets(nbytes), self.loss)), self.max_lost(nbytes))

    def draw_delay(self, rng: np.random.Generator) -> float:
        """One frame's one-way delay: ``rtt / 2`` plus uniform jitter, never below 0."""
        delay = self.one_way_delay
        if self.jitter > 0:
            delay += float(rng.uniform(-self.jitter, self.jitter))
        return max(0.0, delay)

    def max_delivery_s(self, nbytes: int) -> float:
        """The longest an honest sender's stamp can lie ahead of its write for an
        ``nbytes`` frame: burst, serialisation, worst-case loss, delay and jitter."""
        return (
            self.serialisation_s(nbytes + self.burst_bytes)
            + self.max_lost(nbytes) * self.rtt
            + self.one_way_delay
            + self.jitter
            + CLOCK_SLACK_S
        )

    def transfer_s(self, nbytes: int, rng: np.random.Generator | None = None) -> float:
        """Seconds one isolated transfer of ``nbytes`` takes end to end: serialisation,
        lost packets' round trips and one one-way delay (without ``rng``: the mean)."""
        if rng is None:
            lost = self.packets(nbytes) * self.loss
            return self.serialisation_s(nbytes) + lost * self.rtt + self.one_way_delay
        return (
            self.serialisation_s(nbytes)
            + self.draw_lost(nbytes, rng) * self.rtt
            + self.draw_delay(rng)
        )

    def describe(self) -> str:
        """A one-line summary, e.g. ``5g: 100 Mbit/s, rtt 20 ms ± 2 ms, loss 0``."""
        rate = "unlimited" if math.isinf(self.bandwidth) else f"{self.bandwidth / MBIT:g} Mbit/s"
        return (
            f"{self.name}: {rate}, rtt {self.rtt * 1e3:g} ms ± {self.jitter * 1e3:g} ms, "
            f"loss {self.loss:g}"
        )


def _profile(name: str, mbit: float, rtt_ms: float, jitter_ms: float) -> LinkProfile:
    return LinkProfile(name, mbit * MBIT, rtt_ms / 1e3, jitter_ms / 1e3)


PROFILES: dict[str, LinkProfile] = {
    "none": LinkProfile("none", math.inf, 0.0),
    # Switched gigabit Ethernet in one rack.
    "lan": _profile("lan", 1000.0, 0.2, 0.0),
    # A good 5G (NR, sub-6 GHz) connection: the 100 Mbit/s and 20 ms RTT.
    "5g": _profile("5g", 100.0, 20.0, 2.0),
    # A typical LTE connection.
    "4g": _profile("4g", 20.0, 50.0, 5.0),
    # A cross-region Internet path between data centres.
    "wan": _profile("wan", 50.0, 80.0, 4.0),
}
"""The named profiles of ``TrainConfig.link_profile``; symmetric, no loss by default
(add ``link.loss`` for a lossy path)."""


def link_profile(
    name: str,
    *,
    bandwidth_mbit: float = 0.0,
    rtt_ms: float = 0.0,
    jitter_ms: float = 0.0,
    loss: float = 0.0,
    seed: int = 0,
) -> LinkProfile | None:
    """The named profile with the non-zero figures replaced; ``None`` if unshaped.

    A 0 keeps the profile's figure, as in the config (``none`` has no rate limit and
    no delay, so ``link_profile("none", rtt_ms=50)`` is a pure 50 ms RTT link).
    """
    base = PROFILES.get(name)
    if base is None:
        raise ConfigError(
            f"unknown link profile {name!r}: use one of {', '.join(PROFILES)} (or 'none' with "
            "explicit link.bandwidth_mbit / link.rtt_ms)"
        )
    for key, value in (
        ("bandwidth_mbit", bandwidth_mbit),
        ("rtt_ms", rtt_ms),
        ("jitter_ms", jitter_ms),
    ):
        if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
            raise ConfigError(f"link.{key}={value!r} must be a finite number >= 0 (0 = profile's)")
    custom = bool(bandwidth_mbit or rtt_ms or jitter_ms or loss)
    profile = LinkProfile(
        name=f"{name}+custom" if custom else name,
        bandwidth=bandwidth_mbit * MBIT if bandwidth_mbit else base.bandwidth,
        rtt=rtt_ms / 1e3 if rtt_ms else base.rtt,
        jitter=jitter_ms / 1e3 if jitter_ms else base.jitter,
        loss=loss if loss else base.loss,
        burst_bytes=base.burst_bytes,
        seed=int(seed),
    )
    return None if profile.unshaped else profile


class LinkSettings(Protocol):
    """The options a job's link is read from. A :class:`~sparktrain.config.TrainConfig`
    has them; wire/ sits below the config, so it names only what it reads."""

    link_profile: str
    link_bandwidth_mbit: float
    link_rtt_ms: float
    link_jitter_ms: float
    link_loss: float
    seed: int


def link_from_config(cfg: LinkSettings) -> LinkProfile | None:
    """The link a training job's connections emulate, or ``None`` (unshaped)."""
    return link_profile(
        cfg.link_profile,
        bandwidth_mbit=cfg.link_bandwidth_mbit,
        rtt_ms=cfg.link_rtt_ms,
        jitter_ms=cfg.link_jitter_ms,
        loss=cfg.link_loss,
        seed=cfg.seed,
    )


@dataclass(frozen=True)
class Booking:
    """When a frame booked on a :class:`LinkShaper` releases its sender and arrives
    (both ``time.monotonic()`` seconds)."""

    release: float
    due: float


def make_rng(seed: int | Sequence[int]) -> np.random.Generator:
    """A generator seeded by an int or a sequence of ints (negative ones allowed)."""
    keys = [seed] if isinstance(seed, int) else list(seed)
    return np.random.default_rng([int(k) % (1 << 64) for k in keys])


class LinkShaper:
    """One direction of one emulated link: the virtual clock of the module docstring.

    :meth:`book` is called by the sender for each frame, in send order; it never
    sleeps (the caller does, so that it can wake up early when its connection closes).
    Thread-safe. ``seed`` (an int or a sequence of ints, e.g. the profile seed and
    both ranks) makes the jitter and loss draws reproducible.
    """

    def __init__(self, profile: LinkProfile, seed: int | Sequence[int] | None = None) -> None:
        self.profile = profile
        self._rng = make_rng(profile.seed if seed is None else seed)
        self._lock = threading.Lock()
        self._link_free = -math.inf  # when the link finishes the last booked frame
        self._last_due = -math.inf
        self.frames = 0
        """Frames booked."""
        self.bytes = 0
        """Wire bytes booked."""
        self.lost_packets = 0
        """Packets the loss model dropped (each cost one RTT)."""
        self.hold_s = 0.0
        """Seconds this connection's senders were blocked by the bandwidth limit."""
        self.wait_s = 0.0
        """Seconds this connection's receiver held frames from the peer until they were due
        (the peer's link, counted here because the hold happens on this side)."""

    def __repr__(self) -> str:
        return f"<LinkShaper {self.profile.describe()}>"

    def book(self, nbytes: int, now: float | None = None) -> Booking:
        """Put an ``nbytes`` frame (header included) on the link at ``now`` (default:
        ``time.monotonic()``); returns when its sender may go on and when it arrives."""
        if nbytes < 0:
            raise ValueError(f"cannot book a frame of {nbytes} bytes")
        p = self.profile
        with self._lock:
            if now is None:
                now = time.monotonic()
            lost = p.draw_lost(nbytes, self._rng)
            start = max(now, self._link_free)
            finish = start + p.serialisation_s(nbytes) + lost * p.rtt
            self._link_free = finish
            due = max(finish + p.draw_delay(self._rng), self._last_due)
            self._last_due = due
            self.frames += 1
            self.bytes += nbytes
            self.lost_packets += lost
        return Booking(release=max(now, finish - p.serialisation_s(p.burst_bytes)), due=due)

    def add_hold(self, seconds: float) -> None:
        """Count time a sender spent blocked on this link."""
        with self._lock:
            self.hold_s += seconds

    def add_wait(self, seconds: float) -> None:
        """Count time a receiver spent holding a frame until it was due."""
        with self._lock:
            self.wait_s += seconds

    def as_dict(self) -> dict[str, float]:
        """A snapshot of the counters."""
        with self._lock:
            return {
                "frames": self.frames,
                "bytes": self.bytes,
                "lost_packets": self.lost_packets,
                "hold_s": self.hold_s,
                "wait_s": self.wait_s,
            }


def emulate_transfer(
    profile: LinkProfile | None,
    nbytes: int,
    rng: np.random.Generator | Sequence[int] | None = None,
    *,
    max_seconds: float = 3600.0,
) -> float:
    """Sleep as long as an isolated ``nbytes`` transfer takes on ``profile``; returns
    the seconds slept (0 when ``profile`` is ``None``).

    For transfers that do not go through sparktrain's transport (``tree_aggregate``
    rides on Spark's sockets, which cannot be shaped): serialisation at the bandwidth,
    lost packets' round trips, and one one-way delay with jitter, drawn from ``rng`` (a
    generator, or a seed such as ``(seed, partition, round)``; default: the mean
    figures). Never sleeps longer than ``max_seconds``.
    """
    if nbytes < 0:
        raise ValueError(f"cannot emulate a transfer of {nbytes} bytes: give a size >= 0")
    if profile is None:
        return 0.0
    gen = rng if isinstance(rng, np.random.Generator) or rng is None else make_rng(rng)
    seconds = min(profile.transfer_s(int(nbytes), gen), max_seconds)
    if seconds > 0:
        time.sleep(seconds)
    return seconds


def emulate_task_transfer(cfg: LinkSettings, nbytes: int, *keys: int) -> float:
    """:func:`emulate_transfer` on the job's link (``cfg``), jitter and loss seeded by
    ``cfg.seed`` and ``keys`` (e.g. partition, round, direction); for tasks whose bytes
    travel on Spark's sockets (``tree_aggregate``). Returns the seconds slept."""
    return emulate_transfer(link_from_config(cfg), nbytes, (cfg.seed, *keys))
