"""The parameter server's checkpoints: what survives a driver restart.

With ``strategy="ps"`` the model lives in the driver, so the driver checkpoints it (the
workers' copies are not authoritative and save nothing). A checkpoint holds, per shard,
the parameters, the optimizer state, the version and the ledger (every rank's last
accepted global step and its applied pushes) plus the staleness histogram, in a
:class:`~sparktrain.checkpoint.Checkpoint` (tensors and plain values only, read back
with ``weights_only=True``) under ``<checkpoint_dir>/ps/``: its own directory, so it never
collides with the ring's per-step worker checkpoints.

Cadence: the same ``checkpoint_every`` (in epochs) as the other strategies, i.e. every
``max(1, round(checkpoint_every * steps_per_epoch))`` global steps. A driver thread
(:class:`ServerCheckpointer`) polls the server's completed step (sync: steps applied;
async/ssp: the steps every rank pushed) and, once a multiple of that interval is passed,
snapshots the shards (each under its own lock, then written outside every lock) with
``step`` = the snapshot's completed step. A snapshot is only written once the epoch
records of the epochs it completes have reached the driver, so the resumed run's history
is whole; otherwise the next poll tries again.

Resuming (``resume=true``): :func:`restore` loads the newest checkpoint into a fresh
server before the first stage; the workers continue at its step with its history. A
shard whose version is ahead of that step (the snapshot caught it between two shards)
takes the resent pushes as duplicates, so no step is applied twice.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from sparktrain.checkpoint import Checkpoint, CheckpointStore, open_for_run
from sparktrain.config import TrainConfig
from sparktrain.errors import CheckpointError
from sparktrain.strategies.ps.server import ParameterServer

log = logging.getLogger(__name__)

SUBDIR = "ps"
FORMAT = 1
POLL_S = 0.25  # how often the checkpointer looks at the server's progress

History = tuple[dict[str, Any], ...]


def server_store(cfg: TrainConfig) -> CheckpointStore | None:
    """The server's checkpoint store (``<checkpoint_dir>/ps``), or None without one."""
    if not cfg.checkpoint_dir:
        return None
    uri = f"{cfg.checkpoint_dir.rstrip('/')}/{SUBDIR}"
    return open_for_run(uri, cfg.keep_checkpoints, resume=cfg.resume)


def completed_step(state: dict[str, Any]) -> int:
    """The global step a snapshot (:meth:`ParameterServer.state`) lets every rank
    continue from: sync, the fewest steps any shard applied; async/ssp, the fewest steps
    any rank pushed to any shard."""
    shards = state["shards"]
    if state["mode"] == "sync":
        return min(int(s["version"]) for s in shards)
    return min(1 + min(s["last_steps"], default=-1) for s in shards)


def to_checkpoint(state: dict[str, Any], history: Sequence[dict[str, Any]]) -> Checkpoint:
    """A :class:`Checkpoint` of a server snapshot and the epochs done by its step."""
    shards = state["shards"]
    return Checkpoint(
        step=completed_step(state),
        model_state={f"shard{i}": s["values"] for i, s in enumerate(shards)}
        | {
            f"shard{i}.table{t}": table["values"]
            for i, s in enumerate(shards)
            for t, table in enumerate(s.get("tables", []))
        },
        optimizer_state={f"shard{i}": s["optimizer"] for i, s in enumerate(shards)}
        | {
            f"shard{i}.table{t}": table["optimizer"]
            for i, s in enumerate(shards)
            for t, table in enumerate(s.get("tables", []))
        },
        rng_state=torch.get_rng_state(),
        history=list(history),
        extra={
            "ps_format": FORMAT,
            "mode": state["mode"],
            "world_size": state["world_size"],
            "ranges": state["ranges"],
            "tables": state.get("tables", []),
            "shards": [
                {k: s[k] for k in ("version", "applied", "last_steps", "rank_applied", "staleness")}
                for s in shards
            ],
        },
    )


def from_checkpoint(ckpt: Checkpoint) -> dict[str, Any]:
    """The server snapshot a checkpoint holds (inverse of :func:`to_checkpoint`)."""
    extra = ckpt.extra
    if extra.get("ps_format") != FORMAT:
        raise CheckpointError(
            f"checkpoint of step {ckpt.step} is not a parameter-server checkpoint "
            f"(format {extra.get('ps_format')!r}); point checkpoint_dir elsewhere"
        )
    tables = extra.get("tables", [])  # sparse tables: [name, rows, dim] (docs/sparse_ps.md)
    shards = [
        dict(
            meta,
            values=ckpt.model_state[f"shard{i}"],
            optimizer=ckpt.optimizer_state[f"shard{i}"],
            tables=[
                {
                    "values": ckpt.model_state[f"shard{i}.table{t}"],
                    "optimizer": ckpt.optimizer_state[f"shard{i}.table{t}"],
                }
                for t in range(len(tables))
            ],
        )
        for i, meta in enumerate(extra["shards"])
    ]
    return {
        "mode": extra["mode"],
        "world_size": extra["world_size"],
        "ranges": extra["ranges"],
        "tables": tables,
        "shards": shards,
    }


def restore(store: CheckpointStore, server: ParameterServer) -> tuple[int, History] | None:
    """Load the newest checkpoint into ``server``; its ``(step, history)``, or None if
    there is none yet (the run starts from scratch)."""
    ckpt = store.load()
    if ckpt is None:
        log.info("no parameter-server checkpoint in %s yet: starting from scratch", store.uri)
        return None
    state = from_checkpoint(ckpt)
    server.load_state(state)
    log.info(
        "parameter server resumed from the checkpoint of step %d (version %s)",
        ckpt.step,
        [s["version"] for s in state["shards"]],
    )
    return ckpt.step, tuple(ckpt.history)


class ServerCheckpointer:
    """A driver thread that checkpoints the server every ``checkpoint_every`` epochs.

    ``steps_per_epoch`` and ``history_before`` come from the run's progress channel
    (0 / empty until the first stage reports); see the module docstring for the cadence.
    """

    def __init__(
        self,
        server: ParameterServer,
        store: CheckpointStore,
        every_epochs: float,
        steps_per_epoch: Callable[[], int],
        history_before: Callable[[int], History],
        *,
        start_step: int = 0,
        poll_s: float = POLL_S,
    ) -> None:
        self.server = server
        self.store = store
        self.every_epochs = every_epochs
        self.steps_per_epoch = steps_per_epoch
        self.history_before = history_before
        self.poll_s = poll_s
        self.saved_step = start_step  # the resumed step, or 0
        self.saves = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="sparktrain-ps-checkpointer", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop polling; waits for a write in progress (bounded by ``timeout``)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.maybe_save()
            except Exception as exc:  # a failed write must not kill training; say so
                log.warning("parameter-server checkpoint failed: %s", exc)

    def maybe_save(self) -> int | None:
        """Write a checkpoint if one is due and complete; its step, else None."""
        spe = self.steps_per_epoch()
        if spe <= 0:
            return None
        every = max(1, round(self.every_epochs * spe))
        if self.server.completed_step() // every <= self.saved_step // every:
            return None
        state = self.server.state()
        if state["mode"] == "sync" and len({int(s["version"]) for s in state["shards"]}) > 1:
            # the shards are copied one after another: a later shard may already hold the
            # next step. Such a cut is no checkpoint of any one step: take it next poll.
            return None
        step = completed_step(state)
        history = self.history_before(step)
        if step // every <= self.saved_step // every or len(history) < step // spe:
            return None  # the epoch records have not all arrived yet: next poll
        path = self.store.save(to_checkpoint(state, history))
        self.saved_step = step
        self.saves += 1
        log.info("parameter server checkpointed at step %d: %s", step, path)
        return step


def merged_history(earlier: History, reported: History, steps_per_epoch: int, step: int) -> History:
    """The epoch records done by ``step``: those reported in this run, completed by those
    a resumed checkpoint brought (a restarted driver never saw the earlier epochs)."""
    latest = {int(h["epoch"]): h for h in earlier}
    latest.update({int(h["epoch"]): h for h in reported})
    done = step // steps_per_epoch if steps_per_epoch > 0 else 0
    out = []
    for epoch in range(done):
        if epoch not in latest:
            break
        out.append(latest[epoch])
    return tuple(out)
