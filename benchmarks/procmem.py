"""Peak memory of a process tree's Python processes, sampled from ``/proc`` (Linux).

The head-to-head bench compares sparktrain and TorchDistributor by the memory of the
Python processes each one runs: the driver, Spark's Python daemon and workers (children
of the JVM), torchrun and its ranks. The JVMs are common to both (each starts the same
SparkSession), so processes whose command name is ``java`` are left out; their Python
descendants are not.

The measure, the same for every contender: every ``interval_s`` the sampler lists the
root and all its descendants, reads each non-java process's ``Pss`` and ``Rss`` from
``/proc/<pid>/smaps_rollup`` and sums them; the result is the largest sum seen.

* ``peak_pss_bytes`` (the figure the bench judges): proportional set size, where a page
  shared by k processes counts 1/k in each. Spark's Python workers fork from a daemon
  that has torch loaded, so their shared pages would be counted once per process by RSS;
  PSS counts every page once in the sum.
* ``peak_rss_bytes``: the same sum over resident set sizes (shared pages counted in
  every process that maps them), for comparison with tools that report RSS.

A peak shorter than ``interval_s`` can be missed; the sampler runs in the parent, so
reading ``/proc`` does not add to the measured processes' memory.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

PROC = Path("/proc")
EXCLUDED_COMMANDS = frozenset({"java"})  # the JVMs: the same for every contender


@dataclass
class MemorySample:
    """One reading of a tree: summed bytes over its non-excluded processes."""

    pss_bytes: int = 0
    rss_bytes: int = 0
    processes: int = 0
    # (pid, what runs: the command line's first words, pss bytes) per process
    per_process: list[tuple[int, str, int]] = field(default_factory=list)


def describe(pid: int, words: int = 3) -> str:
    """A process's command line, its first ``words`` words (python -m pyspark.daemon ...),
    or "" when it is gone."""
    try:
        raw = (PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return ""
    return " ".join(
        Path(w).name if i == 0 else w
        for i, w in enumerate(raw.decode(errors="replace").split("\0")[:words])
    ).strip()


def _parent_and_command(pid: int) -> tuple[int, str] | None:
    """(ppid, comm) from ``/proc/<pid>/stat``, or None when the process is gone."""
    try:
        raw = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # comm is in parentheses and may itself hold spaces or ')': split at the last ')'
    head, _, tail = raw.rpartition(")")
    command = head.partition("(")[2]
    fields = tail.split()
    if len(fields) < 2:
        return None
    return int(fields[1]), command


def descendants(root: int) -> dict[int, str]:
    """``{pid: command}`` of ``root`` and every process below it (a snapshot)."""
    children: dict[int, list[int]] = {}
    commands: dict[int, str] = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        info = _parent_and_command(int(entry.name))
        if info is None:
            continue
        pid = int(entry.name)
        commands[pid] = info[1]
        children.setdefault(info[0], []).append(pid)
    if root not in commands:
        return {}
    found: dict[int, str] = {}
    todo = [root]
    while todo:  # bounded: every pid is visited once (a tree has no cycles)
        pid = todo.pop()
        if pid in found or pid not in commands:
            continue
        found[pid] = commands[pid]
        todo.extend(children.get(pid, []))
    return found


def process_memory(pid: int) -> tuple[int, int] | None:
    """(pss, rss) in bytes of one process, or None when it is gone or unreadable."""
    try:
        text = (PROC / str(pid) / "smaps_rollup").read_text()
    except OSError:
        return None
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in ("Pss", "Rss"):
            values[key] = int(rest.split()[0]) * 1024  # the kernel reports kB
    if "Pss" not in values or "Rss" not in values:
        return None
    return values["Pss"], values["Rss"]


def sample_tree(root: int, excluded: frozenset[str] = EXCLUDED_COMMANDS) -> MemorySample:
    """The summed memory of ``root``'s tree now, without the ``excluded`` commands."""
    out = MemorySample()
    for pid, command in descendants(root).items():
        if command in excluded:
            continue
        mem = process_memory(pid)
        if mem is None:  # exited between the listing and the read
            continue
        out.pss_bytes += mem[0]
        out.rss_bytes += mem[1]
        out.processes += 1
        out.per_process.append((pid, describe(pid), mem[0]))
    return out


@dataclass
class TreeMemorySampler:
    """Samples a process tree in a background thread until :meth:`stop`; keeps the
    largest summed PSS and RSS (each its own maximum) and how many samples it took."""

    root: int
    interval_s: float = 0.1
    peak_pss_bytes: int = 0
    peak_rss_bytes: int = 0
    peak_processes: int = 0
    samples: int = 0
    # the processes of the sample with the largest summed PSS: where the memory is
    peak_breakdown: list[tuple[int, str, int]] = field(default_factory=list, repr=False)
    # (time.time(), summed pss, summed rss) per sample: peaks of a part of the run
    timeline: list[tuple[float, int, int]] = field(default_factory=list, repr=False)
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {self.interval_s}")
        if not (PROC / "self" / "smaps_rollup").exists():
            raise RuntimeError(
                "this kernel has no /proc/<pid>/smaps_rollup (Linux >= 4.14 needed) to "
                "measure process memory; run the bench on Linux or skip the memory figures"
            )

    def sample_once(self) -> MemorySample:
        """Take one sample now and fold it into the peaks."""
        now = sample_tree(self.root)
        self.timeline.append((time.time(), now.pss_bytes, now.rss_bytes))
        self.samples += 1
        if now.pss_bytes > self.peak_pss_bytes:
            self.peak_pss_bytes = now.pss_bytes
            self.peak_breakdown = now.per_process
        self.peak_rss_bytes = max(self.peak_rss_bytes, now.rss_bytes)
        self.peak_processes = max(self.peak_processes, now.processes)
        return now

    def peak_until(self, until: float) -> tuple[int, int]:
        """(summed pss, summed rss) peaks over the samples taken up to ``until``
        (``time.time()``), e.g. before a second, warm call in the same process."""
        early = [(pss, rss) for t, pss, rss in self.timeline if t <= until]
        return max((p for p, _ in early), default=0), max((r for _, r in early), default=0)

    def start(self) -> TreeMemorySampler:
        self._thread = threading.Thread(target=self._run, name="tree-memory", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample_once()
            self._stop.wait(self.interval_s)

    def stop(self, timeout_s: float = 5.0) -> dict[str, int]:
        """Stop sampling (waits at most ``timeout_s`` for the thread) and return the
        peaks: ``peak_pss_bytes``, ``peak_rss_bytes``, ``peak_processes``, ``samples``."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
        return {
            "peak_pss_bytes": self.peak_pss_bytes,
            "peak_rss_bytes": self.peak_rss_bytes,
            "peak_processes": self.peak_processes,
            "samples": self.samples,
        }
