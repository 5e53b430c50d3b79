"""The parameter server's consistency rules: which pushes count, when a pull is answered.

Each shard keeps a :class:`Ledger` for its mode (``ps_mode``): the shard's version and,
per rank, the last global step it pushed and accepted, its applied pushes and whether
it said goodbye. The shard holds the parameters and the optimizer and does the
arithmetic; the ledger decides.

* ``sync`` (:class:`SyncLedger`) — the shard accumulates ``sum(n_r * g_r)`` and
  ``sum(n_r)`` for the current step; once every live rank has pushed for it (count 0
  included) the shard applies the optimizer to the sample-weighted mean, exactly the
  ring's rule (task/buckets.py). A pull for step ``t`` waits until step ``t`` is
  applied. The version counts the steps applied.
* ``async`` (:class:`AsyncLedger`) — every push with samples is applied at once
  (Downpour/Hogwild); its staleness is the shard's version minus the version the worker
  computed on. The version counts the updates applied.
* ``ssp`` (:class:`SspLedger`) — as async, but a rank that has pushed ``c`` steps
  waits on its pull until the slowest live rank has pushed at least ``c - staleness``
  steps.

With ``staleness_lr`` a push of staleness ``k`` is applied with the learning rate
scaled by ``1/(1 + k)`` (:func:`lr_scale`: the step is scaled, whatever the optimizer).

Duplicates: ``step`` is the rank's global step (it continues across reconnections,
stage attempts and resumed runs), so a push of a step at or below the rank's last
accepted one is a resend, acknowledged and never applied twice. Across a stage attempt
(:meth:`Ledger.new_attempt`) and in a checkpoint (:meth:`Ledger.state`) a rank keeps its
last accepted step; in sync mode the steps of the unfinished step are dropped with its
partial sum, so the ranks push that step again.

The ledger is not thread-safe: the shard calls it holding its own lock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from sparktrain.errors import ConfigError
from sparktrain.strategies.ps import protocol


@dataclass
class RankLedger:
    """What one shard's ledger knows about one rank."""

    last_step: int = -1  # highest global step pushed and accepted (kept across attempts)
    applied: int = 0  # pushes with samples applied (async/ssp; checkpointed)
    done: bool = False  # said a clean goodbye: no longer expected to push

    @property
    def clock(self) -> int:
        """Steps pushed."""
        return self.last_step + 1


Readiness = tuple[bool, int, str]
"""``(ready, laggard, why)``: may a pull be answered; if not, the rank it waits for
(or :data:`~sparktrain.strategies.ps.protocol.NO_RANK`) and why, for the lost-rank message."""

_READY: Readiness = (True, protocol.NO_RANK, "")


class Ledger:
    """The rules every mode shares: a push is the rank's next step, or a duplicate."""

    mode: ClassVar[str]

    def __init__(self, world_size: int, *, staleness: int = 0, where: str = "the shard") -> None:
        self.ranks = {r: RankLedger() for r in range(world_size)}
        self.staleness = staleness
        self.where = where  # for messages, e.g. "shard 3"
        self.version = 0
        self.applied = 0  # sync: steps completed by step number; async/ssp: as restored

    def live(self) -> list[int]:
        """The ranks still expected to push (no goodbye yet)."""
        return [r for r, s in self.ranks.items() if not s.done]

    def check_push(self, rank: int, step: int) -> tuple[int, str]:
        """``(OK | DUPLICATE | PROTOCOL, reason)`` for a push of ``step`` by ``rank``."""
        last = self.ranks[rank].last_step
        if step <= last:
            return protocol.DUPLICATE, ""
        if step != last + 1:
            return protocol.PROTOCOL, f"rank {rank} pushed step {step} after step {last}"
        return protocol.OK, ""

    def record_push(self, rank: int, step: int) -> None:
        """Take the push :meth:`check_push` found OK."""
        self.ranks[rank].last_step = step

    def goodbye(self, rank: int) -> None:
        """``rank`` finished cleanly: no longer expected to push."""
        self.ranks[rank].done = True

    def ready(self, rank: int, step: int) -> Readiness:
        """May a pull by ``rank`` after pushing ``step`` be answered?"""
        raise NotImplementedError

    def ssp_gap(self, step: int) -> int:
        """How far a pull after ``step`` runs ahead of the slowest live rank (ssp only)."""
        return 0

    def completed_step(self) -> int:
        """The global steps every rank has done on this shard."""
        raise NotImplementedError

    def applied_pushes(self) -> int:
        """The summary's applied figure: distinct steps (sync) or pushes (async/ssp)."""
        raise NotImplementedError

    def _carried_step(self, state: RankLedger) -> int:
        """A rank's last step as a new attempt or a checkpoint keeps it."""
        return state.last_step

    def new_attempt(self) -> None:
        """Forget goodbyes and unfinished work; keep every rank's ledger (the new
        attempt's workers continue the global step count)."""
        self.ranks = {
            r: RankLedger(last_step=self._carried_step(s), applied=s.applied)
            for r, s in self.ranks.items()
        }

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: version, applied and the carried ledger."""
        return {
            "version": self.version,
            "applied": self.applied,
            "last_steps": [self._carried_step(s) for s in self.ranks.values()],
            "rank_applied": [s.applied for s in self.ranks.values()],
        }

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state`."""
        self.version = int(state["version"])
        self.applied = int(state["applied"])
        for r, (last, applied) in enumerate(
            zip(state["last_steps"], state["rank_applied"], strict=True)
        ):
            self.ranks[r] = RankLedger(last_step=int(last), applied=int(applied))


class SyncLedger(Ledger):
    """Every live rank pushes each step; the step is applied once they all did."""

    mode = "sync"

    def __init__(self, world_size: int, *, staleness: int = 0, where: str = "the shard") -> None:
        super().__init__(world_size, staleness=staleness, where=where)
        self.pushed: set[int] = set()  # the ranks that pushed the current step

    def check_push(self, rank: int, step: int) -> tuple[int, str]:
        status, reason = super().check_push(rank, step)
        if status == protocol.OK and step != self.version:
            return protocol.PROTOCOL, (
                f"rank {rank} pushed step {step} while {self.where} is at step {self.version}"
            )
        return status, reason

    def record_push(self, rank: int, step: int) -> None:
        super().record_push(rank, step)
        self.pushed.add(rank)

    def step_complete(self) -> bool:
        """Has every live rank pushed the current step (and someone at all)?"""
        return bool(self.pushed) and set(self.live()) <= self.pushed

    def close_step(self) -> None:
        """The current step was applied (or had no samples): on to the next."""
        # the steps completed, by the step number the ranks pushed (the ledger), not by
        # the version counter: a step applied twice would make the two differ
        self.applied = 1 + max(self.ranks[r].last_step for r in self.pushed)
        self.pushed.clear()
        self.version += 1

    def ready(self, rank: int, step: int) -> Readiness:
        if step < 0 or self.version > step:
            return _READY
        missing = sorted(set(self.live()) - self.pushed)
        laggard = missing[0] if missing else protocol.NO_RANK
        return False, laggard, f"it did not push step {step}"

    def completed_step(self) -> int:
        return self.version

    def applied_pushes(self) -> int:
        return self.applied

    def _carried_step(self, state: RankLedger) -> int:
        return min(state.last_step, self.version - 1)

    def new_attempt(self) -> None:
        super().new_attempt()
        self.pushed.clear()


class AsyncLedger(Ledger):
    """Every push with samples is applied at once; pulls never wait."""

    mode = "async"

    def staleness_of(self, version: int) -> int:
        """The staleness of a gradient computed on ``version``."""
        return max(0, self.version - version)

    def record_update(self, rank: int) -> None:
        """``rank``'s push was applied."""
        self.version += 1
        self.ranks[rank].applied += 1

    def ready(self, rank: int, step: int) -> Readiness:
        return _READY

    def completed_step(self) -> int:
        return min((s.clock for s in self.ranks.values()), default=0)

    def applied_pushes(self) -> int:
        return sum(s.applied for s in self.ranks.values())


class SspLedger(AsyncLedger):
    """As async, but no rank runs more than ``staleness`` steps ahead of the slowest."""

    mode = "ssp"

    def ready(self, rank: int, step: int) -> Readiness:
        live = self.live()
        if step < 0 or not live:
            return _READY
        slowest = min(live, key=lambda r: self.ranks[r].clock)
        if self.ranks[slowest].clock >= step + 1 - self.staleness:
            return _READY
        return False, slowest, f"it stayed more than {self.staleness} steps behind (step {step})"

    def ssp_gap(self, step: int) -> int:
        if step < 0:
            return 0
        return step + 1 - min((self.ranks[r].clock for r in self.live()), default=step + 1)


LEDGERS: dict[str, type[Ledger]] = {c.mode: c for c in (SyncLedger, AsyncLedger, SspLedger)}


def make_ledger(mode: str, world_size: int, *, staleness: int, where: str) -> Ledger:
    """The ledger of ``ps_mode`` ``mode`` for ``world_size`` ranks."""
    try:
        cls = LEDGERS[mode]
    except KeyError:
        raise ConfigError(f"ps_mode must be one of {sorted(LEDGERS)}, got {mode!r}") from None
    return cls(world_size, staleness=staleness, where=where)


def lr_scale(staleness: int, staleness_lr: bool) -> float:
    """The learning-rate factor of a push of ``staleness`` (``1/(1 + k)`` with
    ``staleness_lr``, else 1)."""
    return 1.0 / (1 + staleness) if staleness_lr else 1.0
