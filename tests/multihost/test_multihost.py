"""Training across a small multi-host cluster: two Spark workers, each in a network
namespace of its own, linked to the driver's namespace by veths that ``tc tbf`` shapes
(:mod:`tests.cluster.netcluster`). The tasks' traffic crosses real interfaces, so
their byte counters can be held against what the summary says went on the wire.

Marked ``multihost`` (not in the default run; ``./dev test-marked`` and .ci/run run it).
Needs root, ``ip`` and ``tc``; skipped with the reason elsewhere.
"""

from __future__ import annotations

import pytest

from benchmarks import multihost
from tests.cluster.netcluster import NetCluster, unavailable

pytestmark = [pytest.mark.multihost, pytest.mark.spark, pytest.mark.timeout(300)]

RATE_MBIT = 100.0
EPOCHS = 5


@pytest.fixture(scope="module")
def net(tmp_path_factory):  # type: ignore[no-untyped-def]
    reason = unavailable()
    if reason is not None:
        pytest.skip(f"no multi-host cluster here: {reason}")
    with NetCluster(tmp_path_factory.mktemp("netcluster"), workers=2, rate_mbit=RATE_MBIT) as c:
        yield c


@pytest.fixture(scope="module")
def mh_spark(net, _sessions):  # type: ignore[no-untyped-def]
    conf = net.spark_conf()
    session = _sessions.get(conf.pop("spark.master"), conf=conf, mode="+netns")
    try:
        net.wait_for_executors(session)
        yield session
    finally:
        _sessions.stop()  # before the cluster goes


@pytest.fixture(scope="module")
def digits(mh_spark):  # type: ignore[no-untyped-def]
    job = multihost.workload("digits", EPOCHS, 0)
    data = multihost.frames(mh_spark, job)
    yield job, data
    data[0].unpersist(), data[1].unpersist()


def test_the_cluster_is_two_namespaces_behind_shaped_veths(net) -> None:  # type: ignore[no-untyped-def]
    qdiscs = net.qdiscs()
    assert len(qdiscs) == 4  # both ends of both workers' veths
    for where, shown in qdiscs.items():
        assert "tbf" in shown and "100Mbit" in shown, (where, shown)
    assert net.url.startswith("spark://10.213.7.1:")


@pytest.mark.parametrize("strategy", ["ring", "tree", "ps", "tree_aggregate"])
def test_digits_trains_across_the_namespaces(net, mh_spark, digits, strategy: str) -> None:  # type: ignore[no-untyped-def]
    job, data = digits
    before = net.counters()
    rec = multihost.sparktrain_fit(mh_spark, net, data, job, strategy)
    after = net.counters()
    # tree_aggregate averages local SGD (64 local steps: one round per epoch), so 5 epochs
    # are 5 averagings; measured 0.86-0.91 on this cluster (8 local steps: 0.88)
    assert rec["accuracy"] > (0.8 if strategy == "tree_aggregate" else 0.9), rec
    per_worker = [
        (b.sent - a.sent, b.received - a.received) for a, b in zip(before, after, strict=True)
    ]
    wire = rec["wire_bytes"]
    assert wire > 0
    # every byte sparktrain wrote went over a veth: between the workers (ring, tree at
    # world 2) it leaves one namespace and enters the other; to and from the driver (ps,
    # tree_aggregate) it crosses one worker's veth
    assert sum(s + r for s, r in per_worker) >= wire, (per_worker, wire)
    if strategy in ("ring", "tree"):
        assert sum(s for s, _ in per_worker) >= wire, (per_worker, wire)
    if strategy == "tree_aggregate":
        # its rounds are plain (not barrier) stages: Spark places each task where the cached
        # partition lives and may run both partitions on one executor, so only the total holds
        return
    for sent, received in per_worker:  # both workers took part
        assert sent + received >= 0.25 * wire, (per_worker, wire)


def test_ddp_under_torch_distributor_across_the_namespaces(net, mh_spark) -> None:  # type: ignore[no-untyped-def]
    job = multihost.workload("digits", EPOCHS, 0)
    before = net.counters()
    rec = multihost.ddp_fit(net, job, "digits", 0)
    after = net.counters()
    assert rec["accuracy"] > 0.9, rec
    params = 64 * 128 + 128 + 128 * 10 + 10
    # Gloo's allreduce at world 2: each rank sends at least its half twice every step
    sent = sum(b.sent - a.sent for a, b in zip(before, after, strict=True))
    assert sent >= rec["steps"] * params * 4, (sent, rec)


def test_own_link_emulation_against_the_kernel_token_bucket(net, mh_spark) -> None:  # type: ignore[no-untyped-def]
    """Ring on the synthetic MLP (5.3 MB of gradient), 100 Mbit/s: tbf on the veths vs
    sparktrain's own emulation on unshaped veths, the benchmark's comparison end to end.
    Both runs train, every byte crosses the veths either way, and the shaping is put back.
    How close the two come in time per step is the benchmark's claim (within 15 %:
    ``python -m benchmarks multihost --parts compare``), not a test's: wall time on a shared
    machine is no pass/fail criterion."""
    records = multihost.compare_link(
        mh_spark, net, "synthetic", ["ring"], RATE_MBIT, repeats=1, epochs=2, samples=2048
    )
    errors = [r["error"] for r in records if "error" in r]
    assert not errors, errors
    assert net.rate_mbit == RATE_MBIT  # the shaping the other tests expect is back
    assert sorted(r["mode"] for r in records) == ["emulated", "tbf"]
    for rec in records:
        assert rec["steps"] > 0 and rec["wire_bytes"] > 0, rec
        assert rec["veth_bytes"] >= rec["wire_bytes"], rec  # over the veths, shaped or not
    verdict = multihost.link_verdicts(records)[0]
    print(verdict)
    assert verdict["contender"] == "ring" and verdict["ratio"] is not None, verdict
