"""Run one function per rank in threads, with Spark-like allGather/barrier — for testing
executor-side code without Spark."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class ThreadCollectives:
    """allGather and barrier for `world` threads, bounded by a timeout."""

    def __init__(self, world: int, timeout: float = 60.0) -> None:
        self._barrier = threading.Barrier(world, timeout=timeout)
        self._slots: list[Any] = [None] * world

    def all_gather(self, rank: int, message: str) -> list[str]:
        self._slots[rank] = message
        self._barrier.wait()
        out = list(self._slots)
        self._barrier.wait()
        return out

    def barrier(self) -> None:
        self._barrier.wait()


def run_ranks(
    world: int, fn: Callable[[int, ThreadCollectives], T], timeout: float = 120.0
) -> list[T]:
    """Call fn(rank, collectives) in `world` threads; re-raise the first failure."""
    coll = ThreadCollectives(world)
    results: list[Any] = [None] * world
    errors: list[BaseException | None] = [None] * world

    def body(rank: int) -> None:
        try:
            results[rank] = fn(rank, coll)
        except BaseException as exc:  # reported below
            errors[rank] = exc
            coll._barrier.abort()

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        if t.is_alive():
            raise TimeoutError(f"a rank did not finish within {timeout} s")
    real = [e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)]
    if real or any(errors):
        raise (real or [e for e in errors if e])[0]  # type: ignore[misc]
    return results
