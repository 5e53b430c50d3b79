"""The first exchange of every barrier task: split off validation rows, check the
data, then one ``all_gather`` of (listener address, row counts, error) so every rank
learns its peers and the world's row counts, and a rank that found bad data makes
*every* rank raise the same error before any socket is used (nobody waits for a peer
that already failed).
"""

from __future__ import annotations

import json
import threading
from typing import Any

from sparktrain import errors
from sparktrain.data.partition_data import PartitionData, check_labels
from sparktrain.task.context import WorkerContext
from sparktrain.wire import Mesh, address_of, open_listener
from sparktrain.wire.link import link_from_config

# torch's global RNG is per process; ranks run as threads (in tests, or several tasks in one
# reused Python worker) must not interleave seeding and initialisation.
SEEDED_INIT = threading.Lock()


def rendezvous(
    ctx: WorkerContext, data: PartitionData, *, builtin_loop: bool = True
) -> tuple[Mesh, list[dict[str, Any]], PartitionData, PartitionData]:
    """Split off validation rows, check labels, then one ``all_gather`` of (listener
    address, row counts, error): every rank learns its peers, and if any rank found bad
    data *all* ranks raise before a socket is used. Returns the mesh, every rank's info,
    and this rank's train and validation rows. The built-in loop needs training rows and
    (cross-entropy) labels in range; ``sparktrain.run`` leaves both to its train_fn."""
    job, cfg = ctx.job, ctx.job.config
    problem: str | None = None
    train, val = data, data
    try:
        train, val = data.split(cfg.validation_fraction, cfg.seed, ctx.rank)
        if builtin_loop and cfg.loss == "cross_entropy":
            check_labels(data.y, job.num_outputs, ctx.rank)
    except errors.SparkTrainError as exc:
        problem = f"{type(exc).__name__}: {exc}"
    listener = open_listener(ctx.host)
    try:
        mine = {"address": address_of(listener), "train": train.size, "val": val.size}
        infos = [json.loads(s) for s in ctx.all_gather(json.dumps({**mine, "error": problem}))]
        raise_first_error(infos)
        if builtin_loop and sum(i["train"] for i in infos) == 0:
            raise errors.DataError("the training data is empty on every worker")
        mesh = Mesh(
            ctx.rank,
            ctx.world_size,
            listener,
            [i["address"] for i in infos],
            secret=job.secret,
            job_id=job.job_id,
            attempt=job.attempt,
            timeout=cfg.comm_timeout,
            link=link_from_config(cfg),
            security=job.security,
            max_frame_bytes=job.max_frame_bytes,
        )
    except BaseException:
        listener.close()
        raise
    return mesh, infos, train, val


def raise_first_error(infos: list[dict[str, Any]]) -> None:
    """Raise, on every rank alike, the first error any rank reported in the all-gather."""
    for rank, info in enumerate(infos):
        if info["error"]:
            name, _, message = info["error"].partition(": ")
            error_cls = getattr(errors, name, errors.SparkTrainError)
            raise error_cls(message if f"rank {rank}" in message else f"rank {rank}: {message}")
