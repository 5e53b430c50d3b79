"""The task side of :func:`sparktrain.run` and of ``Trainer.fit`` with ring, tree or
ps: meet the peers, build the rank's
:class:`~sparktrain.task.run_context.RunContext`, call the ``train_fn`` (the user's,
or the built-in loop, :func:`~sparktrain.task.loop.builtin_loop`) and send rank 0's
return value to the driver.

A user's return value travels without pickle: its tensors through the state codec
(streamed to the driver's state receiver), everything else as JSON with a placeholder
per tensor. The built-in loop's model goes as the fit's model state.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from sparktrain import errors
from sparktrain.builders import import_callable
from sparktrain.checkpoint import CheckpointStore
from sparktrain.compress import registry as compress_registry
from sparktrain.data.partition_data import PartitionData, steps_for
from sparktrain.result import Record
from sparktrain.task.context import WorkerContext
from sparktrain.task.device import device_for, place
from sparktrain.task.loop import TrainedModel, builtin_loop
from sparktrain.task.meet import rendezvous
from sparktrain.task.memory import peak_anon_bytes, peak_rss_bytes, reset_peak_rss
from sparktrain.task.metrics_client import start_reporter
from sparktrain.task.run_context import RunContext
from sparktrain.task.state_sender import return_state

TENSOR_KEY = "__tensor__"


def run_partition(ctx: WorkerContext, data: PartitionData) -> list[Record]:
    """Run the job's ``train_fn`` (the built-in loop without one) on this rank; rank 0's
    return value goes to the driver, every rank's figures too."""
    spec, cfg = ctx.job, ctx.job.config
    # the driver's plug-in compressors, before anything here builds one
    compress_registry.install(spec.compressors)
    torch.set_num_threads(max(1, spec.threads))
    reset_peak_rss()  # the summary's peak is this task's, not a reused worker's past
    started = time.perf_counter()
    builtin = spec.train_fn is None
    train_fn = builtin_loop if builtin else resolve_train_fn(spec.train_fn)
    # before any socket: device="cuda" without a GPU fails on every rank alike
    placement = place(device_for(cfg), ctx.gpus)
    mesh, infos, train, val = rendezvous(ctx, data, builtin_loop=builtin)
    spec = ctx.job  # a task that could not reach the driver met through Spark: no addresses
    try:
        rows = [int(i["train"]) for i in infos]
        steps = _steps_per_epoch(rows, cfg.batch_size, cfg.drop_last, builtin)
        reporter = None
        if ctx.rank == 0:
            reporter = start_reporter(
                spec, steps_per_epoch=steps, world_size=ctx.world_size, train_samples=sum(rows)
            )
        store = (
            CheckpointStore(cfg.checkpoint_dir, cfg.keep_checkpoints)
            if cfg.checkpoint_dir
            else None
        )
        run = RunContext(
            ctx,
            mesh,
            train,
            val,
            steps_per_epoch=steps,
            rows_per_rank=rows,
            val_rows_per_rank=[int(i["val"]) for i in infos],
            reporter=reporter,
            store=store,
            placement=placement,
        )
        try:
            value = train_fn(run)
            if not builtin and ctx.rank == 0:  # the server's tables, if the value has them
                run.pull_returned_tables(value)
        finally:
            run.close()
            if reporter is not None:
                reporter.close()
        stats = {**run.stats(), "task_s": time.perf_counter() - started}
        records = []
        if isinstance(value, TrainedModel):
            stats.update(value.stats)
            if ctx.rank == 0:
                meta = {"history": run.history, **value.meta}
                records += return_state(spec, 0, value.state, meta)
        elif ctx.rank == 0:
            skeleton, tensors = encode_value(value)
            meta = {
                "history": run.history,
                "value": skeleton,
                "early_stopping": (
                    run.early_stopping.summary() if run.early_stopping.active else None
                ),
            }
            records += return_state(spec, 0, tensors, meta)
        # after the state went out: their true peaks
        stats["peak_rss_bytes"] = peak_rss_bytes()
        stats["peak_anon_bytes"] = peak_anon_bytes()
        return [Record(ctx.rank, "stats", 0, json.dumps(stats).encode()), *records]
    finally:
        mesh.close()


def _steps_per_epoch(rows: list[int], batch_size: int, drop_last: bool, builtin: bool) -> int:
    """The steps every rank takes per epoch. The built-in loop needs a full batch
    somewhere under ``drop_last`` (a rank short of rows idles); a user's ``train_fn``
    needs rows on every rank or none, and gets one short batch rather than none."""
    if builtin:
        steps = max(steps_for(n, batch_size, drop_last) for n in rows)
        if steps == 0:
            raise errors.DataError(
                f"drop_last=true but no partition holds a full batch of {batch_size} "
                "rows: lower batch_size or set drop_last=false"
            )
        return steps
    if any(rows) and not all(rows):
        empty = [r for r, n in enumerate(rows) if n == 0]
        raise errors.DataError(
            f"ranks {empty} have no training rows while others do: give the data at "
            "least as many rows as num_workers (it is repartitioned evenly)"
        )
    return max(steps_for(n, batch_size, drop_last) or steps_for(n, batch_size) for n in rows)


def resolve_train_fn(train_fn: Any) -> Callable[[RunContext], Any]:
    """A callable, or an importable ``"package.module:function"``."""
    if isinstance(train_fn, str):
        return import_callable(train_fn, what="train_fn")
    if not callable(train_fn):
        raise errors.ConfigError(
            f"train_fn must be a callable or a 'package.module:function' string, got {train_fn!r}"
        )
    return train_fn


def encode_value(value: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """``value`` as JSON with ``{"__tensor__": "t<i>"}`` in place of each tensor (numpy
    arrays become tensors), and the tensors by those names."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(item: Any, where: str) -> Any:
        if isinstance(item, np.ndarray):
            item = torch.from_numpy(np.ascontiguousarray(item))
        if isinstance(item, torch.Tensor):
            name = f"t{len(tensors)}"
            tensors[name] = item.detach().cpu().contiguous()
            return {TENSOR_KEY: name}
        if isinstance(item, np.generic):
            return item.item()
        if item is None or isinstance(item, bool | int | float | str):
            return item
        if isinstance(item, Mapping):
            out = {}
            for key, sub in item.items():
                if not isinstance(key, str):
                    raise errors.ConfigError(
                        f"train_fn returned a dict with the key {key!r} at {where}: keys "
                        "must be strings (the value travels as JSON plus tensors)"
                    )
                out[key] = walk(sub, f"{where}[{key!r}]")
            return out
        if isinstance(item, list | tuple):
            return [walk(sub, f"{where}[{i}]") for i, sub in enumerate(item)]
        raise errors.ConfigError(
            f"train_fn returned a {type(item).__name__} at {where}: return tensors, state "
            "dicts, numbers, strings, lists or dicts (no pickle travels back; return "
            "model.state_dict() rather than the model)"
        )

    return walk(value, "the top"), tensors


def decode_value(skeleton: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Inverse of :func:`encode_value` (tuples come back as lists)."""
    if isinstance(skeleton, dict):
        if set(skeleton) == {TENSOR_KEY}:
            return tensors[skeleton[TENSOR_KEY]]
        return {k: decode_value(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [decode_value(v, tensors) for v in skeleton]
    return skeleton
