"""``shard_optimizer = true``: optimizer state sharded over the ranks (ZeRO stage 1).

:class:`ShardedSync` is :class:`~sparktrain.task.step_sync.AllreduceSync` (the same
buckets, weighting by rows, overlap thread) with the ring allreduce cut in its two
halves:

1. each gradient bucket (holding grads x rows) is *reduce-scattered*: rank ``r`` ends
   with the summed segment ``(r + 1) % n`` of every bucket (the ring's
   :meth:`~sparktrain.wire.ring.RingAllreduce.owned_segment`), bitwise the bytes the
   full allreduce would have given it;
2. the row counts are summed by a tiny tree allreduce (the count slot of bucket 0 lies
   in one rank's segment only) and the owned segments divided by the total rows;
3. a torch optimizer of the user's class steps :class:`nn.Parameter` views of the owned
   segments only, so torch does the math and momentum / Adam moments exist for
   ``1/n`` of the parameters on each rank;
4. the parameters are *all-gathered*, bucket by bucket, from the owners.

To make the segments of parameters addressable, every bucket gets a flat parameter
buffer laid out like its gradient buffer, and the model's parameters become views into
it (``p.data = view``, as apex's flat parameters): no copy of the model is kept.

The slices are identified by segment index, which follows the ring position: a
checkpoint shard records the segment it holds and the layout of the slices, and a
restore checks both, so a resume with the same world size maps slices by index
whichever task gets which rank. Any other world size is refused.

Limits (refused by :func:`check_sharding` or here): ring/tree only (the exchange always
uses the ring's halves: the tree has no reduce-scatter), no compression, the
``sparktrain`` comm backend, no pipeline, no fp16 loss scaling, parameters on the CPU,
one parameter group.
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import torch
from torch import nn

from sparktrain.config import check_sharding
from sparktrain.errors import CheckpointError, ConfigError
from sparktrain.sparse.rows import sparse_parameters
from sparktrain.task.context import WorkerContext
from sparktrain.task.step_sync import AllreduceSync
from sparktrain.wire import Mesh, RingAllreduce, TreeAllreduce
from sparktrain.wire.ring import DEFAULT_CHUNK_BYTES, ring_segments

STATE_KEY = "zero1"
SHARDED_WORLD = "shard_optimizer_world"
"""A checkpoint's ``extra`` key: the world size whose ranks hold its optimizer slices."""


def check_sharded_resume(extra: dict[str, Any], sharded: bool, world: int, step: int) -> None:
    """Refuse a resume that would lose or misplace sharded optimizer state: a sharded
    checkpoint into an unsharded run or another world size, or an unsharded one into a
    sharded run (its full optimizer state has no slices)."""
    saved = int(extra.get(SHARDED_WORLD, 0) or 0)
    if saved and not sharded:
        raise CheckpointError(
            f"the checkpoint of step {step} holds optimizer state sharded over {saved} "
            "ranks (shard_optimizer=true): resume with shard_optimizer=true"
        )
    if sharded and not saved:
        raise CheckpointError(
            f"the checkpoint of step {step} was written without shard_optimizer: resume "
            "with shard_optimizer=false"
        )
    if sharded and saved != world:
        raise CheckpointError(
            f"the checkpoint of step {step} holds optimizer slices of {saved} ranks, this "
            f"run has {world}: resume with the same world size"
        )


class ShardedSync(AllreduceSync):
    """ZeRO-1 over the ring halves (see the module docstring)."""

    def __init__(self, ctx: WorkerContext, model: nn.Module, mesh: Mesh) -> None:
        check_sharding(ctx.job.config)
        if ctx.job.config.sparse_embeddings == "auto" and sparse_parameters(model):
            # a slice of a table's optimizer state per rank would need the rows routed to
            # their owners: not built; the dense tables shard as before
            raise ConfigError(
                "shard_optimizer=true does not shard sparse=True embedding tables: set "
                "sparse_embeddings='off' (the tables are then exchanged and sharded "
                "densely) or shard_optimizer=false (the tables' rows are exchanged)"
            )
        super().__init__(ctx, model, mesh)
        if self.staging is not None:
            raise ConfigError(
                "shard_optimizer=true steps on the CPU; the model is on "
                f"{self.staging.device}: use device='cpu'"
            )
        chunk = max(8, min(DEFAULT_CHUNK_BYTES, mesh.max_frame_bytes))
        self.ring = RingAllreduce(mesh, chunk_bytes=chunk)
        self.tree = TreeAllreduce(mesh)  # the row counts and the norm: a few floats
        self.segment = self.ring.owned_segment()
        self.param_flats: list[np.ndarray] = []
        self.slices: list[tuple[int, int, int]] = []  # (bucket, start, stop) owned here
        self.owned_params: list[nn.Parameter] = []
        self._flatten_parameters()
        self.shard_optimizer: torch.optim.Optimizer | None = None
        self.user_optimizer: torch.optim.Optimizer | None = None

    def _flatten_parameters(self) -> None:
        """Give every bucket a flat parameter buffer laid out like its gradients, make
        the parameters views into it, and build the owned slices' parameters."""
        n = self.mesh.world_size
        with torch.no_grad():
            for b in self.buckets.buckets:
                flat = np.zeros_like(b.flat)  # same length: the ring segments match
                tensor = torch.from_numpy(flat)
                offset = 0
                for p in b.params:
                    view = tensor[offset : offset + p.numel()].view_as(p)
                    view.copy_(p.data)
                    p.data = view
                    offset += p.numel()
                self.param_flats.append(flat)
                start, stop = ring_segments(b.flat.size, n)[self.segment]
                stop = min(stop, b.grads.numel())  # never the count slot
                if start >= stop:
                    continue
                self.slices.append((b.index, start, stop))
                owned = nn.Parameter(tensor[start:stop])
                owned.grad = b.tensor[start:stop]
                self.owned_params.append(owned)

    @property
    def owned_elements(self) -> int:
        """Parameters whose optimizer state lives on this rank."""
        return sum(stop - start for _, start, stop in self.slices)

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Build the optimizer of the owned slices: ``optimizer``'s own class and
        defaults (its state stays empty; its groups' hyperparameters, which schedules
        move, are copied over before every step)."""
        if len(optimizer.param_groups) != 1:
            raise ConfigError(
                "shard_optimizer=true supports an optimizer with one parameter group, "
                f"got {len(optimizer.param_groups)}"
            )
        self.user_optimizer = optimizer
        if not self.owned_params:  # a world larger than the model: nothing to step here
            return
        base = getattr(type(optimizer), "_sparktrain_base", type(optimizer))
        # the constructor's arguments among the defaults (AdamW's defaults hold a key
        # its constructor does not take); every group key is copied at each step anyway
        accepted = inspect.signature(base.__init__).parameters
        kwargs = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        self.shard_optimizer = base(self.owned_params, **kwargs)
        self._copy_hyperparameters()

    # ------------------------------------------------------------------ the exchange
    def _exchange(self, index: int) -> None:
        """Reduce-scatter bucket ``index`` (the communication thread with overlap)."""
        b = self.buckets.buckets[index]
        before = self.mesh.stats.as_dict()
        self.buckets.fill(b)
        if b.count_slot:  # unused here (the tree sums the rows); kept finite
            b.flat[-1] = 0.0
        self.ring.reduce_scatter_(b.flat)
        after = self.mesh.stats.as_dict()
        self._bucket_raw[index] += after["raw_bytes_sent"] - before["raw_bytes_sent"]
        self._bucket_wire[index] += after["wire_bytes_sent"] - before["wire_bytes_sent"]

    def _finish(self, count: int) -> None:
        """Divide the owned slices by the total rows over the ranks."""
        rows = np.array([float(count)])
        self.tree.allreduce_(rows)
        if rows[0] <= 0:
            raise RuntimeError("no rank contributed samples to this step")
        for p in self.owned_params:
            assert p.grad is not None
            p.grad.div_(float(rows[0]))

    def clip_grad_norm_(self, max_norm: float) -> float:
        """``torch.nn.utils.clip_grad_norm_`` over the whole model's averaged gradients,
        from the owned slices: their squared norms are summed over the ranks (float64).
        Returns the global norm."""
        sq = np.array([sum(float(torch.sum(g.double() ** 2)) for g in self._grads())])
        self.tree.allreduce_(sq)
        norm = float(np.sqrt(sq[0]))
        coef = min(1.0, max_norm / (norm + 1e-6))  # torch's formula
        for g in self._grads():
            g.mul_(coef)
        return norm

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.owned_params if p.grad is not None]

    def step_owned(self) -> None:
        """Step the owned slices with the user's optimizer's current hyperparameters
        (then :meth:`gather` the parameters)."""
        if self.shard_optimizer is not None:
            self._copy_hyperparameters()
            self.shard_optimizer.step()

    def _copy_hyperparameters(self) -> None:
        """The user's group's current values (learning rate, betas, ...) to the slices'."""
        assert self.shard_optimizer is not None and self.user_optimizer is not None
        group = self.shard_optimizer.param_groups[0]
        for key, value in self.user_optimizer.param_groups[0].items():
            if key != "params":
                group[key] = value

    def gather(self) -> None:
        """Every rank's owned parameter segments to every rank."""
        for flat in self.param_flats:
            self.ring.allgather_(flat)

    def reduce(self, count: int, micro: int = 1) -> None:
        """Reduce-scatter every bucket (overlapping backward as :class:`AllreduceSync`
        does) and divide the owned slices by the total rows. Only the owned slices of
        the gradients are meaningful afterwards."""
        self._reduce_buckets(count, micro)
        self._finish(count)

    def step(self, count: int) -> None:
        """Average and step without a :class:`DistributedStep` (the bench's path)."""
        self.reduce(count)
        if self.shard_optimizer is None and self.owned_params:
            self.attach(self.optimizer)
        self.step_owned()
        self.gather()
        self.optimizer.zero_grad(set_to_none=False)

    def stats(self) -> dict[str, Any]:
        """:class:`AllreduceSync`'s figures plus the sharding's."""
        return {
            **super().stats(),
            "shard_optimizer": True,
            "optimizer_state_elements": self.owned_elements,
        }

    # ------------------------------------------------------------------ checkpoints
    def rank_state(self) -> dict[str, Any] | None:
        """The owned slices' optimizer state, with the segment index and layout that
        identify them."""
        return {
            STATE_KEY: {
                "world": self.mesh.world_size,
                "segment": self.segment,
                "slices": [list(s) for s in self.slices],
                "optimizer": (
                    self.shard_optimizer.state_dict() if self.shard_optimizer is not None else {}
                ),
            }
        }

    def load_rank_state(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`rank_state`'s output for this rank's segment."""
        saved = state.get(STATE_KEY)
        if saved is None:
            raise CheckpointError(
                "the checkpoint holds no sharded optimizer state: it was written without "
                "shard_optimizer=true; resume with the same setting"
            )
        if saved["world"] != self.mesh.world_size:
            raise CheckpointError(
                f"the sharded optimizer state was saved by {saved['world']} ranks, this run "
                f"has {self.mesh.world_size}: resume with the same world size"
            )
        if saved["segment"] != self.segment or [tuple(s) for s in saved["slices"]] != (self.slices):
            raise CheckpointError(
                f"rank {self.mesh.rank} owns segment {self.segment} {self.slices}, the shard "
                f"it was given holds segment {saved['segment']} {saved['slices']}: resume "
                "with the same model and bucket_mb"
            )
        if self.shard_optimizer is not None and saved["optimizer"]:
            self.shard_optimizer.load_state_dict(saved["optimizer"])
