"""Micro-batch schedules: the order in which one stage runs its forwards and backwards.

A schedule for stage ``s`` of ``P`` with ``M`` micro-batches is a list of
``("F", i)`` / ``("B", i)``. Every stage runs backwards in ascending micro-batch order,
so that the frames on each connection arrive in the order they are read.

- **GPipe**: all M forwards, then all M backwards. A stage holds M micro-batches'
  activations at once.
- **1F1B** (PipeDream-flush): ``min(P - s - 1, M)`` warm-up forwards, then alternate one
  forward and one backward, then the remaining backwards. Stage ``s`` holds at most
  ``P - s`` (so at most P) micro-batches' activations at once; the bubble is the same as
  GPipe's, the activation memory is bounded by P instead of M.

Both give the same gradients (the same sums, in a different order). The ideal bubble
fraction of either is ``(P - 1) / (M + P - 1)``.
"""

from __future__ import annotations

from sparktrain.errors import ConfigError

Op = tuple[str, int]
SCHEDULES = ("gpipe", "1f1b")


def gpipe(stage: int, stages: int, micro: int) -> list[Op]:
    """All forwards, then all backwards."""
    del stage, stages
    return [("F", i) for i in range(micro)] + [("B", i) for i in range(micro)]


def one_f_one_b(stage: int, stages: int, micro: int) -> list[Op]:
    """Warm-up forwards, steady one-forward-one-backward, cool-down backwards."""
    warmup = min(stages - stage - 1, micro)
    ops: list[Op] = [("F", i) for i in range(warmup)]
    for i in range(micro - warmup):
        ops += [("F", warmup + i), ("B", i)]
    ops += [("B", i) for i in range(micro - warmup, micro)]
    return ops


def make_schedule(name: str, stage: int, stages: int, micro: int) -> list[Op]:
    """The schedule called ``name`` (``gpipe`` or ``1f1b``) for one stage."""
    key = name.lower().replace("-", "").replace("_", "")
    if key == "gpipe":
        return gpipe(stage, stages, micro)
    if key == "1f1b":
        return one_f_one_b(stage, stages, micro)
    raise ConfigError(f"unknown pipeline schedule {name!r}: choose one of {', '.join(SCHEDULES)}")


def max_in_flight(ops: list[Op]) -> int:
    """The most micro-batches whose forward ran and backward did not yet, at any time."""
    live = peak = 0
    for kind, _ in ops:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak


def ideal_bubble(stages: int, micro: int) -> float:
    """Idle share of a synchronous pipeline with equal stages: (P - 1) / (M + P - 1)."""
    return (stages - 1) / (micro + stages - 1) if micro > 0 else 0.0
