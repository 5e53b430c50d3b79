"""pyspark's Python worker daemon, with torch and sparktrain's worker code loaded before
it forks.

Spark starts one daemon per executor (``python -m pyspark.daemon``) and forks a Python
worker from it for each task slot. A fresh worker then imports torch and our training
loop on its first task: about 1 s of CPU per worker, plus ~0.8 s for the lazy import
torch's first optimizer does, paid by every slot on the path to the first step. Set

    spark.python.daemon.module = sparktrain.driver.daemon

(:func:`sparktrain.session.get_or_create_session` and ``conf/spark-defaults.conf`` do)
and the daemon pays it once, before forking: each worker starts with the modules already
in memory (shared copy-on-write).

Why this is safe to fork: importing torch (and numpy) runs no tensor operation, so no
intra-op thread pool exists yet; the one thread that does start at import, OpenBLAS's,
is covered by its ``pthread_atfork`` handlers (PyTorch's DataLoader forks its workers
the same way). pyarrow, whose import starts a jemalloc thread, and pyspark's worker
module are still imported after the fork, as pyspark does.

If preloading fails (a broken install on one executor), the daemon says why on stderr
and carries on as the plain pyspark daemon: tasks then fail or succeed exactly as
without this module. Nothing may be printed to stdout: the daemon's first bytes there
are the port Spark reads.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from typing import Any


def preload() -> None:
    """Import torch and run its first-optimizer import: the costly part of a task's start.

    Not pyarrow (nor our modules that import it): pyarrow starts jemalloc's background
    thread at import, which pyspark's daemon keeps out of the process it forks from.
    """
    with contextlib.redirect_stdout(sys.stderr):
        import torch

        # torch's first optimizer imports torch._dynamo lazily (~0.8 s): do it here
        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


def _quiet_on_a_closed_socket(worker: Callable[..., int]) -> Callable[..., int]:
    """pyspark's per-task ``worker`` call, ending the forked worker without a stack trace
    when the JVM has already closed the task's socket (the session stopped or the task
    was killed while it still wrote): nobody is left to read it, and pyspark's manager
    would print a ``BrokenPipeError`` trace on the user's terminal before exiting 1."""

    def run(*args: Any) -> int:
        try:
            return worker(*args)
        except (BrokenPipeError, ConnectionResetError):
            os._exit(1)

    return run


def main() -> None:
    """Preload, then run pyspark's daemon manager (which never returns normally)."""
    try:
        preload()
    except Exception as exc:  # carry on as the plain daemon
        print(f"sparktrain.driver.daemon: preloading failed ({exc!r})", file=sys.stderr)
    import pyspark.daemon

    pyspark.daemon.worker = _quiet_on_a_closed_socket(pyspark.daemon.worker)
    pyspark.daemon.manager()


if __name__ == "__main__":
    main()
