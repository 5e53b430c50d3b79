"""This process's resident memory, for the run summary's memory figures: the peak of
all of it (``VmHWM``), and the largest anonymous part seen (``RssAnon``: heap and arrays,
not the page cache of memory-mapped spill files, which the kernel reclaims at will)."""

from __future__ import annotations

import resource
import sys
import threading

_anon_lock = threading.Lock()
_anon_peak = 0


def peak_rss_bytes() -> int:
    """The process's peak resident set size so far (``VmHWM``), in bytes; 0 if unknown.

    Linux reports it in ``/proc/self/status``; elsewhere ``getrusage`` (kilobytes on
    Linux, bytes on macOS). Threads share it: ranks run as threads report one figure.
    """
    hwm = _status_bytes("VmHWM")
    if hwm is not None:
        return hwm
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def reset_peak_rss() -> bool:
    """Restart the peak at the current size (Linux >= 4.0: ``clear_refs`` mode 5), so
    that :func:`peak_rss_bytes` measures from here: a reused Python worker otherwise
    reports the peak of an earlier task. Best effort; returns whether it worked."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as refs:
            refs.write("5")
    except OSError:
        return False
    return True


def anon_rss_bytes() -> int:
    """The process's anonymous resident memory now (``RssAnon``), in bytes; 0 if unknown."""
    return _status_bytes("RssAnon") or 0


def _status_bytes(field: str) -> int | None:
    """A kB figure of Linux's ``/proc/self/status``, in bytes; None elsewhere."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def sample_anon() -> int:
    """Read ``RssAnon`` and keep the largest value seen since :func:`reset_peak_anon`.
    Linux has no high-water mark of anonymous memory, so the data path samples it where
    it peaks: per ingested batch and per epoch."""
    global _anon_peak
    now = anon_rss_bytes()
    with _anon_lock:
        _anon_peak = max(_anon_peak, now)
    return now


def peak_anon_bytes() -> int:
    """The largest ``RssAnon`` sampled since :func:`reset_peak_anon` (0: never sampled)."""
    sample_anon()
    return _anon_peak


def reset_peak_anon() -> None:
    """Start the sampled peak afresh (a reused Python worker's earlier tasks do not count)."""
    global _anon_peak
    with _anon_lock:
        _anon_peak = 0
