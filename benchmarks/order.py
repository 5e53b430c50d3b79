"""The order contenders run in: interleaved, so that the machine's load drifts over all
of them alike instead of always landing on the one that runs at a given place."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def rotated(items: Sequence[T], repeat: int) -> list[T]:
    """``items`` starting at ``repeat``'s position: over the repeats each one leads in
    turn, so none always runs first after a reshaping or a warm-up."""
    if not items:
        return []
    k = repeat % len(items)
    return [*items[k:], *items[:k]]
