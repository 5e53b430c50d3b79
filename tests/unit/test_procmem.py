"""The head-to-head bench's memory measure: the summed PSS/RSS of a real process tree's
non-java processes, sampled from /proc."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from benchmarks import procmem
from benchmarks import train as bt

MB = 1 << 20

# A parent that starts a "java" (a copy of sleep: its command name is java) and a Python
# child that holds 96 MB of touched memory, then waits for its stdin to close.
TREE = textwrap.dedent(
    """
    import subprocess, sys
    java = subprocess.Popen([sys.argv[1], "60"])
    child = subprocess.Popen(
        [sys.executable, "-c",
         "import sys; b = bytearray(96 << 20); b[::4096] = b'x' * len(b[::4096]); "
         "print('ready', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    assert child.stdout.readline().strip() == "ready"
    print(java.pid, child.pid, flush=True)
    sys.stdin.read()
    child.stdin.close(); child.wait(timeout=30)
    java.kill(); java.wait(timeout=30)
    """
)


@pytest.fixture
def tree(tmp_path: Path):
    java = tmp_path / "java"
    shutil.copy(shutil.which("sleep") or "/bin/sleep", java)
    proc = subprocess.Popen(
        [sys.executable, "-c", TREE, str(java)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        java_pid, child_pid = map(int, proc.stdout.readline().split())
        yield proc, java_pid, child_pid
    finally:
        if proc.stdin:
            proc.stdin.close()
        proc.wait(timeout=60)


def test_descendants_and_the_summed_memory_leave_java_out(tree):
    proc, java_pid, child_pid = tree
    found = procmem.descendants(proc.pid)
    assert found[java_pid] == "java" and child_pid in found and proc.pid in found
    sample = procmem.sample_tree(proc.pid)
    assert sample.processes == 2  # the parent and the Python child, not "java"
    assert sample.pss_bytes >= 96 * MB and sample.rss_bytes >= sample.pss_bytes
    whats = {pid: what for pid, what, _ in sample.per_process}
    assert whats[child_pid].startswith("python") and "-c" in whats[child_pid]
    assert max(sample.per_process, key=lambda p: p[2])[0] == child_pid
    with_java = procmem.sample_tree(proc.pid, excluded=frozenset())
    assert with_java.processes == 3


def test_the_sampler_keeps_the_peak_after_the_memory_is_gone(tree):
    proc, _, _ = tree
    sampler = procmem.TreeMemorySampler(proc.pid, interval_s=0.05).start()
    deadline = time.monotonic() + 10
    while sampler.samples < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    mid = time.time()
    proc.stdin.close()  # the child frees its 96 MB and exits, then the parent
    proc.wait(timeout=60)
    peaks = sampler.stop()
    assert peaks["peak_pss_bytes"] >= 96 * MB and peaks["samples"] >= 3
    assert len(sampler.peak_breakdown) == 2
    assert sampler.peak_until(mid)[0] >= 96 * MB
    assert sampler.peak_until(0.0) == (0, 0)  # no sample that early
    assert procmem.sample_tree(proc.pid).processes == 0  # gone: nothing to read


def test_a_vanished_root_and_bad_intervals():
    assert procmem.descendants(2**22 + 12345) == {}
    assert procmem.process_memory(2**22 + 12345) is None
    with pytest.raises(ValueError, match="interval_s must be > 0"):
        procmem.TreeMemorySampler(1, interval_s=0)


def test_run_child_samples_a_child_until_it_exits():
    code = (
        "import time; b = bytearray(64 << 20); b[::4096] = b'x' * len(b[::4096]); "
        f"time.sleep(0.5); print({bt.RESULT_MARK!r} + '{{}}')"
    )
    out, _, rc, spawned, ended, sampler = bt.run_child([sys.executable, "-c", code], {})
    assert rc == 0 and bt.RESULT_MARK in out and ended - spawned >= 0.5
    assert sampler.peak_pss_bytes >= 64 * MB and sampler.samples >= 2
