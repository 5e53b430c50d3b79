"""Build the next mini-batches in a background thread while the current one trains.

Gathering a shuffled batch is random reads: from memory it is quick, from a spilled
partition's memory map it may wait on the disk. :class:`Prefetcher` runs the gathering
``depth`` batches ahead on one thread (numpy's copies and torch's kernels release the
GIL, so both sides make progress) behind a bounded queue: at most ``depth`` batches wait
in memory. ``depth = 0`` gathers in the caller's thread. Either way the batches are the
same, in the same order: prefetching changes timing, never values.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")
_POLL_S = 0.1


class Prefetcher(Generic[T]):
    """``make(i)`` for ``i`` in ``order``, delivered in order by :meth:`next`.

    ``wait_s`` adds up the time :meth:`next` waited for a batch that was not ready (with
    ``depth = 0``: the time spent making it). An exception in ``make`` is raised by the
    :meth:`next` that would have returned its batch. :meth:`close` stops the thread; it is
    safe to call early (an epoch cut short) and more than once.
    """

    def __init__(self, make: Callable[[int], T], order: Sequence[int], depth: int) -> None:
        self._make = make
        self._order = list(order)
        self._depth = max(0, int(depth))
        self._next = 0
        self.wait_s = 0.0
        self._stop = threading.Event()
        self._queue: queue.Queue[tuple[bool, object]] = queue.Queue(maxsize=max(1, self._depth))
        self._thread: threading.Thread | None = None
        if self._depth and self._order:
            self._thread = threading.Thread(
                target=self._run, name="sparktrain-prefetch", daemon=True
            )
            self._thread.start()

    def _run(self) -> None:
        for i in self._order:
            try:
                item: tuple[bool, object] = (True, self._make(i))
            except BaseException as exc:  # handed to the consumer, which raises it
                item = (False, exc)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=_POLL_S)
                    break
                except queue.Full:
                    continue
            if self._stop.is_set() or not item[0]:
                return

    def next(self) -> T:
        """The next batch in ``order``."""
        if self._next >= len(self._order):
            raise IndexError("every batch of this prefetcher was taken")
        started = time.perf_counter()
        try:
            if self._thread is None:
                return self._make(self._order[self._next])
            while True:
                try:
                    ok, value = self._queue.get(timeout=_POLL_S)
                    break
                except queue.Empty:
                    if not self._thread.is_alive() and self._queue.empty():
                        raise RuntimeError("the prefetch thread ended early") from None
            if not ok:
                assert isinstance(value, BaseException)
                raise value
            return value  # type: ignore[return-value]
        finally:
            self._next += 1
            self.wait_s += time.perf_counter() - started

    def close(self) -> None:
        """Stop the thread and drop the batches it made ahead."""
        self._stop.set()
        if self._thread is not None:
            while True:
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    break
            self._thread.join(timeout=30.0)

    def __enter__(self) -> Prefetcher[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
