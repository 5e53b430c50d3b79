"""Test-only fault injection: make rank r fail once at global step k.

The plan travels in the JobSpec (never through the environment). It fires only if its
marker file does not exist yet and creates the file first, so the resubmitted stage runs
through: exactly one failure per marker, whatever the number of attempts.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

KINDS = ("raise", "exit")


class InjectedFaultError(RuntimeError):
    """The failure a FaultPlan raises (kind="raise")."""


@dataclass(frozen=True)
class FaultPlan:
    rank: int
    step: int
    marker: str  # a path on a filesystem every task can see
    kind: str = "raise"  # "raise": an exception in the task; "exit": os._exit(137)
    also: tuple[FaultPlan, ...] = ()  # further faults of the same run (own markers)
    # ranks that cannot reach the driver's services, in every attempt (a Connect client
    # behind a firewall): their tasks dial a closed port instead
    unreachable_driver: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"FaultPlan.kind must be one of {KINDS}, got {self.kind!r}")

    @classmethod
    def series(cls, plans: Sequence[FaultPlan]) -> FaultPlan:
        """One plan that fires each of ``plans`` once (each needs its own marker)."""
        if not plans or len({p.marker for p in plans}) != len(plans):
            raise ValueError("FaultPlan.series needs plans with distinct markers")
        first, *rest = plans
        return cls(first.rank, first.step, first.marker, first.kind, tuple(rest))

    @classmethod
    def driver_unreachable(cls, ranks: Sequence[int]) -> FaultPlan:
        """A plan that only cuts ``ranks`` off the driver's services (no failure)."""
        return cls(rank=-1, step=-1, marker="", unreachable_driver=tuple(ranks))

    def maybe_fire(self, rank: int, step: int) -> None:
        """Fail here if this is the planned rank and step and it has not failed yet."""
        for plan in self.also:
            plan.maybe_fire(rank, step)
        if rank != self.rank or step != self.step:
            return
        try:
            fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return
        os.close(fd)
        if self.kind == "exit":
            os._exit(137)  # the Python worker dies as if killed by the OOM killer
        raise InjectedFaultError(f"injected fault on rank {rank} at step {step}")
