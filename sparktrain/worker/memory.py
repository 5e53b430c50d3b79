"""This process's peak resident memory, for the run summary's memory figures."""

from __future__ import annotations

import resource
import sys


def peak_rss_bytes() -> int:
    """The process's peak resident set size so far (``VmHWM``), in bytes; 0 if unknown.

    Linux reports it in ``/proc/self/status``; elsewhere ``getrusage`` (kilobytes on
    Linux, bytes on macOS). Threads share it: ranks run as threads report one figure.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
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
