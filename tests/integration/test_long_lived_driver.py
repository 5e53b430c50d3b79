"""A long-lived driver (a notebook, a service): descriptors numbered past 1024 do not
break training (nothing polls with select.select, whose fd_set stops at 1024), and fit
after fit leaves no threads, sockets or temporary files behind, nor memory to speak of."""

from __future__ import annotations

import contextlib
import gc
import os
import resource
import tempfile
import threading
import time
from collections.abc import Iterator

import pytest

from sparktrain import Trainer

from .fixtures import DIGITS_MODEL, digits_frames, fast_config

pytestmark = [pytest.mark.spark, pytest.mark.timeout(900)]

EXTRA_FDS = 1100


@contextlib.contextmanager
def _many_descriptors(count: int) -> Iterator[list[int]]:
    """Hold ``count`` extra open descriptors (raising the soft RLIMIT_NOFILE if it is
    too low), so every socket the driver opens next is numbered above 1024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = len(os.listdir("/proc/self/fd")) + count + 1024
    if soft != resource.RLIM_INFINITY and soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            pytest.fail(f"RLIMIT_NOFILE hard limit {hard} < {need}: cannot run this test here")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    fds: list[int] = []
    try:
        for _ in range(count):
            fds.append(os.open(os.devnull, os.O_RDONLY))
        yield fds
    finally:
        for fd in fds:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_ring_fit_succeeds_with_1100_extra_descriptors_in_the_driver(spark):
    train, test = digits_frames(spark)
    with _many_descriptors(EXTRA_FDS) as fds:
        assert max(fds) > 1024
        probe = os.open(os.devnull, os.O_RDONLY)  # what the driver's next socket gets
        os.close(probe)
        assert probe > 1024
        s = (
            Trainer(DIGITS_MODEL, fast_config(epochs=2, strategy="ring"), spark=spark)
            .fit(train, validation_data=test)
            .summary
        )
    assert s["world_size"] == 2 and s["replicas_in_sync"] and s["metric_value"] > 0.8


# ------------------------------------------------------------------------ 20 fits

STRATEGIES = ("ring", "tree", "ps", "tree_aggregate")
FITS = 20
RSS_GROWTH_MB = 50.0


def _rss_mb() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def _sockets() -> int:
    count = 0
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                count += 1
    return count


def _ours(names: list[str]) -> list[str]:
    return sorted(n for n in names if n.startswith(("sparktrain", ".tmp-")))


def _snapshot() -> dict[str, object]:
    gc.collect()
    threads = sorted(t.name for t in threading.enumerate())
    return {
        "threads": threads,
        "sparktrain_threads": [t for t in threads if t.startswith("sparktrain")],
        "fds": len(os.listdir("/proc/self/fd")),
        "sockets": _sockets(),
        "temp_files": _ours(os.listdir(tempfile.gettempdir())),
    }


def _settled(before: dict[str, object], timeout_s: float = 10.0) -> dict[str, object]:
    """The snapshot once daemon threads that are on their way out have gone (bounded)."""
    deadline = time.monotonic() + timeout_s
    now = _snapshot()
    while now["sparktrain_threads"] and time.monotonic() < deadline:
        time.sleep(0.2)
        now = _snapshot()
    return now


@pytest.mark.soak
def test_twenty_fits_in_one_driver_leave_nothing_behind(spark, tmp_path):
    train, test = digits_frames(spark)
    train.cache().count()
    test.cache().count()

    def fit(i: int) -> None:
        strategy = STRATEGIES[i % len(STRATEGIES)]
        extra = {"local_steps": 8} if strategy == "tree_aggregate" else {}
        cfg = fast_config(epochs=1, strategy=strategy, **extra)
        s = Trainer(DIGITS_MODEL, cfg, spark=spark).fit(train, validation_data=test).summary
        assert s["strategy"] == strategy

    for i in range(len(STRATEGIES)):  # warm-up: imports, JIT, Spark's caches, pools
        fit(i)
    before = _settled({})
    rss_before = _rss_mb()
    started = time.monotonic()
    for i in range(FITS):
        fit(i)
    after = _settled(before)
    rss_after = _rss_mb()
    print(
        f"{FITS} fits in {time.monotonic() - started:.0f} s; RSS {rss_before:.0f} -> "
        f"{rss_after:.0f} MB; fds {before['fds']} -> {after['fds']}; sockets "
        f"{before['sockets']} -> {after['sockets']}; threads {len(before['threads'])} -> "
        f"{len(after['threads'])}"  # type: ignore[arg-type]
    )
    assert after["sparktrain_threads"] == [], after["threads"]
    assert after["threads"] == before["threads"]
    assert after["sockets"] == before["sockets"]
    assert after["fds"] == before["fds"]
    assert after["temp_files"] == before["temp_files"]
    assert rss_after - rss_before < RSS_GROWTH_MB
