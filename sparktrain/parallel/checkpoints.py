"""A pipeline stage's part of the model, and its checkpoints (executor side: no Spark).

Names. A stage's tensors go by the whole model's key names, ``<layer index>.<key>``
(:func:`stage_state`), in checkpoints and in the state it returns, so the parts of all
stages together are the whole model's state dict.

Checkpoints (:class:`StageCheckpoints`). Every rank of a P x D pipeline writes a shard of
the :class:`~sparktrain.checkpoint.CheckpointStore` (``n = P x D`` shards): a stage's
replica 0 (world rank ``s``) its stage's part with its optimizer and RNG state; every
rank its compressor state, if any (error-feedback residuals differ per rank). The last
stage's replica 0 holds the epoch history and writes the main file (step, history, the
layout under :data:`~sparktrain.checkpoint.PIPELINE_LAYOUT`); the checkpoint counts once
all ``n`` shards and the main file are there, whatever order they arrive in. A restore
reads a stage's part from world rank ``s``'s shard, which holds it whatever the number
of replicas was; the split into stages must be the checkpoint's.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from sparktrain.checkpoint import PIPELINE_LAYOUT, RANK_SHARDS, Checkpoint, CheckpointStore
from sparktrain.errors import CheckpointError
from sparktrain.parallel.group import GroupGradientSync

log = logging.getLogger(__name__)


def stage_state(layers: Iterable[tuple[int, nn.Module]]) -> dict[str, torch.Tensor]:
    """The state of ``(layer index, layer)`` pairs under the whole model's key names
    (``<layer index>.<key>``): what one stage checkpoints and returns."""
    return {
        f"{index}.{name}": tensor
        for index, layer in layers
        for name, tensor in layer.state_dict().items()
    }


@dataclass
class StagePart:
    """What a stage trains, checkpoints and returns."""

    module: nn.Sequential
    owned: list[int]  # the whole model's indices of the module's layers
    optimizer: torch.optim.Optimizer | None  # None: the stage has no parameters
    sync: GroupGradientSync | None  # None: one replica, or no parameters

    def state(self) -> dict[str, torch.Tensor]:
        """The stage's state under the whole model's key names."""
        return stage_state(zip(self.owned, self.module, strict=True))

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Load what :meth:`state` returned (strict: every key of every layer)."""
        for index, layer in zip(self.owned, self.module, strict=True):
            prefix = f"{index}."
            layer.load_state_dict(
                {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}
            )


@dataclass(frozen=True)
class StageCheckpoints:
    """One rank's view of a pipeline's checkpoints (module docstring)."""

    store: CheckpointStore
    rank: int  # world rank
    world_size: int
    stage: int
    replica: int
    last: bool  # the last stage: it has the epoch history
    layout: dict[str, Any]  # {"stages": P, "replicas": D, "bounds": [...]}

    def save(self, step: int, part: StagePart, history: list[dict[str, Any]]) -> None:
        """This rank's shard; then, on the last stage's replica 0, the main file."""
        shard: dict[str, Any] = {}
        optimizer = part.optimizer
        if self.replica == 0:
            shard |= {
                "model": part.state(),
                "optimizer": optimizer.state_dict() if optimizer is not None else {},
                "rng": torch.get_rng_state(),
            }
        mine = part.sync.rank_state() if part.sync is not None else None
        if mine is not None:
            shard |= mine
        self.store.save_shard(step, self.rank, self.world_size, shard)
        if self.last and self.replica == 0:
            self.store.save(
                Checkpoint(
                    step=step,
                    model_state={},  # in the stages' shards
                    optimizer_state={},
                    rng_state=torch.get_rng_state(),
                    history=history,
                    extra={RANK_SHARDS: self.world_size, PIPELINE_LAYOUT: self.layout},
                )
            )

    def restore(self, step: int, part: StagePart) -> list[dict[str, Any]]:
        """Load this stage's part of the checkpoint of ``step``; returns its history."""
        ckpt = self.store.load(step)
        if ckpt is None:
            raise CheckpointError(f"checkpoint of step {step} vanished from {self.store.uri}")
        saved = ckpt.extra.get(PIPELINE_LAYOUT)
        if not isinstance(saved, dict):
            raise CheckpointError(
                f"the checkpoint of step {step} in {self.store.uri} was not written by a "
                "pipeline run: resume it with the parallelism it was trained with"
            )
        mine = self.layout
        if (saved["stages"], saved["bounds"]) != (mine["stages"], mine["bounds"]):
            raise CheckpointError(
                f"the checkpoint of step {step} splits the model into stages at layers "
                f"{saved['bounds']}, this run at {mine['bounds']}: resume with the same "
                "parallelism.pipeline and the same split"
            )
        world = int(ckpt.extra[RANK_SHARDS])
        # a stage's replica 0 is world rank `stage` whatever the number of replicas
        shard = self.store.load_shard(step, self.stage, world)
        part.load_state(shard["model"])
        if part.optimizer is not None and shard["optimizer"]:
            part.optimizer.load_state_dict(shard["optimizer"])
        torch.set_rng_state(shard["rng"])
        if part.sync is not None and part.sync.rank_state() is not None:
            if world == self.world_size:
                part.sync.load_rank_state(self.store.load_shard(step, self.rank, world))
            else:
                log.warning(
                    "rank %d: the checkpoint of step %d holds compressor state for %d "
                    "ranks, this run has %d: error-feedback residuals and similar state "
                    "start from zero",
                    self.rank,
                    step,
                    world,
                    self.world_size,
                )
        return ckpt.history
