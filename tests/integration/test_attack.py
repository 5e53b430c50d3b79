"""Issue 15 acceptance: strangers flooding every listener do not slow a fit down.

An attacker in a process of its own (:mod:`tests.integration.attacker`) holds 50 silent
connections and 50 that send random bytes, from 127.0.0.2 and up, against every
listener of the fit: the driver's services and parameter-server shards as they start
(learned through the test-only hook :func:`sparktrain.wire.preauth.set_test_observer`)
and the workers' mesh listeners while the mesh forms (the hook reports each rank's
rendezvous message, before the ranks get the answer, and waits until the flood is
under way; that wait is the harness's, not the system's, and is left out of the
attacked run's time). Every fit must complete and train, with every listener of every
attacked run flooded. The runs come in adjacent pairs, one of each kind, and the median
of the pairs' wall-time ratios (attacked / plain) is printed, not asserted: how much a
flood slows a fit is a timing claim (issue 15's goal: under 20 %), and wall time on a
shared, loaded host is no pass/fail criterion for a test.

Issue 31: the same for a ps fit under a harsher flood (:data:`attacker.HALF_OPEN`:
256 half-open connections per listener from 64 loopback addresses, dialed again the
moment the gate drops one); the issue's goal was at most 1.5x.
"""

from __future__ import annotations

import json
import multiprocessing
import statistics
import time
from collections.abc import Iterator
from typing import Any

import pytest

from sparktrain import Trainer
from sparktrain.wire import preauth
from sparktrain.wire.handshake import HELLO_PREFIX

from . import attacker
from .fixtures import DIGITS_MODEL, digits_frames, fast_config

pytestmark = [pytest.mark.spark, pytest.mark.attack, pytest.mark.timeout(300)]

RUNS = 2  # pairs, one run of each kind, each kind first once
HALF_OPEN_RUNS = 5

STRATEGIES = {
    # rendezvous + metrics channel + meshes
    "ring": {"strategy": "ring"},
    # + two parameter-server shards
    "ps": {"strategy": "ps", "ps_shards": 2},
    # tree_aggregate with delta+: + the weights server
    "tree_aggregate": {
        "strategy": "tree_aggregate",
        "compression": "delta+int8+ef",
        "local_steps": 16,
        "epochs": 2,  # a Spark job per round: keep the rounds few
    },
}


class Attacker:
    """The attacking process and the observer that feeds it targets."""

    def __init__(self, flood: str = "mild") -> None:
        self.flood = attacker.FLOODS[flood]
        ctx = multiprocessing.get_context("spawn")  # never fork a process running a JVM
        self.targets = ctx.Queue()
        self.acks = ctx.Queue()
        self.results = ctx.Queue()
        self.stop_event = ctx.Event()
        self.proc = ctx.Process(
            target=attacker.run,
            args=(self.targets, self.acks, self.results, self.stop_event, 280.0, flood),
            daemon=True,
        )
        self.proc.start()
        self.seen: list[tuple[str, str]] = []
        self.waited = 0.0  # seconds the rendezvous spent waiting for the flood to start

    def observe(self, kind: str, text: str) -> None:
        if kind == "listener":  # a driver service or shard: flood it from now on
            self.seen.append(("driver", text))
            self.targets.put(("driver", text, False))
        elif kind == "rendezvous":  # a rank's mesh listener: flood it before the mesh forms
            address = json.loads(text)["address"]
            self.seen.append(("mesh", address))
            started = time.perf_counter()
            self.targets.put(("mesh", address, True))
            self.acks.get(timeout=5.0)
            self.waited += time.perf_counter() - started

    def finish(self) -> list[dict[str, Any]]:
        self.stop_event.set()
        summary: list[dict[str, Any]] = self.results.get(timeout=10.0)
        self.proc.join(10.0)
        if self.proc.is_alive():
            self.proc.kill()
        return summary


@pytest.fixture
def attack(request: pytest.FixtureRequest) -> Iterator[Attacker]:
    hostile = Attacker(getattr(request, "param", "mild"))
    try:
        yield hostile
    finally:
        preauth.set_test_observer(None)
        if hostile.proc.is_alive():
            hostile.stop_event.set()
            hostile.proc.join(10.0)
            if hostile.proc.is_alive():
                hostile.proc.kill()


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_flood_of_strangers_leaves_a_fit_whole(
    spark: Any, attack: Attacker, strategy: str
) -> None:
    # every fit trains with every listener flooded (checked in paired_runs); the
    # slowdown is printed, not asserted (see the module docstring)
    ratio, walls = paired_runs(spark, attack, strategy, RUNS)
    print(f"{strategy} under a flood: median paired ratio {ratio:.2f} (walls {walls})")


@pytest.mark.parametrize("attack", ["half-open"], indirect=True)
def test_a_half_open_flood_from_64_addresses_leaves_a_ps_fit_whole(
    spark: Any, attack: Attacker
) -> None:
    # the gate used to drop the oldest pending connection, which under this churn is a
    # worker's handshake again and again (issue 31). Every fit must train with every
    # listener flooded; the slowdown is printed, not asserted: on 2 cores the attacker's
    # own process takes one of them (measured 1.42-1.57x at load 3-29)
    assert attacker.PARTIAL_HELLO.startswith(HELLO_PREFIX)  # the attacker speaks it
    ratio, walls = paired_runs(spark, attack, "ps", HALF_OPEN_RUNS)
    print(f"half-open flood: median paired ratio {ratio:.2f} (walls {walls})")


def paired_runs(
    spark: Any, attack: Attacker, strategy: str, runs: int
) -> tuple[float, dict[str, list[float]]]:
    """``runs`` adjacent pairs of fits, one plain and one attacked; returns the median of
    the pairs' ratios (attacked / plain) and the wall times, after checking that every
    listener of every attacked run was flooded."""
    train, test = digits_frames(spark)
    cfg = fast_config(**{"epochs": 3, **STRATEGIES[strategy]})
    # warm-up, the same fit: Python workers, imports, the test frame's conversion
    Trainer(DIGITS_MODEL, cfg, spark=spark).fit(train, validation_data=test)

    walls: dict[str, list[float]] = {"plain": [], "attacked": []}
    for i in range(runs):
        # alternate which kind goes first, so a drift in the host's load favours neither
        for kind in ("plain", "attacked") if i % 2 == 0 else ("attacked", "plain"):
            preauth.set_test_observer(attack.observe if kind == "attacked" else None)
            waited = attack.waited
            started = time.perf_counter()
            result = Trainer(DIGITS_MODEL, cfg, spark=spark).fit(train, validation_data=test)
            # the harness holding the rendezvous while it starts the flood is not the
            # system's slowdown: it is left out (and printed)
            walls[kind].append(time.perf_counter() - started - (attack.waited - waited))
            stage = result.summary["stage_s"]
            held = attack.waited - waited
            print(f"{strategy} {kind}: {walls[kind][-1]:.2f}s (+{held:.2f} held) stage {stage:.2f}")
            preauth.set_test_observer(None)
            assert result.summary["metric_value"] > 0.5  # it trained
    summary = attack.finish()

    # one ratio per adjacent pair, then their median: a slow stretch of the host hits
    # both runs of a pair, and one outlier pair cannot decide the result
    ratio = statistics.median(a / p for p, a in zip(walls["plain"], walls["attacked"], strict=True))
    kinds = sorted({k for k, _ in attack.seen})
    print(
        f"\n{strategy}: plain {walls['plain']} attacked {walls['attacked']} "
        f"median paired ratio {ratio:.3f}; targets {len(summary)} ({kinds}); connections opened "
        f"{sum(t['opened'] for t in summary)}, closed by the servers "
        f"{sum(t['closed_by_server'] for t in summary)}"
    )
    # the attack happened: every listener of every attacked run was flooded
    expected = {"driver"} if strategy == "tree_aggregate" else {"driver", "mesh"}
    assert set(kinds) == expected
    assert len(summary) == len(attack.seen) >= runs * len(expected)
    assert all(t["opened"] >= attack.flood.silent for t in summary), summary
    return ratio, walls
