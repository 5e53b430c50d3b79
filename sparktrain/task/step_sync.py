"""How a rank turns its gradients into the next parameters: one small protocol, one
class per strategy, chosen by name.

- ``ring`` / ``tree``: average gradients with an allreduce (``buckets.py`` for the
  weighting rule), then every rank takes the same optimizer step. With
  ``config.compression`` set (one spec, or a per-layer table), compressed buckets go
  through ``sparktrain.compress.collective``, one reducer per distinct spec; ``none``
  buckets through the plain allreduce.
- ``ps``: push gradients to the parameter server in the driver, pull parameters back
  (``sparktrain.strategies.ps``).

Overlap (``config.overlap``, as torch's DDP): the loop calls :meth:`StepSync.begin_step`
before ``backward()``; from then on a gradient hook hands each bucket, as soon as all its
gradients are final, to one communication thread per rank that reduces buckets strictly
in index order (the same order on every rank, so collectives match), while backward
continues. :meth:`StepSync.step` hands over the buckets no hook completed (parameters
without a gradient this step, or a step without a batch), waits for the thread, then
steps the optimizer. The numbers are the same as with overlap off: the same buffers go
through the same collectives in the same order; only the time they start differs.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from sparktrain.builders import build_optimizer
from sparktrain.compress.collective import CompressedAllreduce
from sparktrain.compress.policy import resolve_policy
from sparktrain.compress.registry import build as build_compressor
from sparktrain.config import TrainConfig
from sparktrain.errors import CommError, ConfigError
from sparktrain.result import by_spec
from sparktrain.sparse.exchange import SparseRowExchange
from sparktrain.sparse.row_codec import row_specs
from sparktrain.sparse.rows import sparse_parameters
from sparktrain.sparse.stepper import SparseStepper
from sparktrain.task.buckets import NONE, GradientBuckets, GradientReadiness
from sparktrain.task.context import WorkerContext
from sparktrain.task.staging import DeviceStaging, staging_device
from sparktrain.wire import Mesh, RingAllreduce, TreeAllreduce, make_allreduce
from sparktrain.wire.chunked import PiecewiseAllreduce
from sparktrain.wire.ring import DEFAULT_CHUNK_BYTES

WAIT_GRACE_S = 5.0
"""Added to ``comm_timeout`` for the backstop on a bucket's exchange: every socket
operation is already bounded by ``comm_timeout``, so this only fires if something below
forgot its bound."""
CLOSE_JOIN_S = 1.0


class StepSync(Protocol):
    """One step's gradient exchange: ``begin_step(count)`` before ``backward()``, then
    ``step(count)`` after it, which leaves the next parameters in the model and zeroed
    gradients behind."""

    def begin_step(self, count: int) -> None:
        """Announce a step of ``count`` samples on this rank before its ``backward()``,
        so exchanges can start from gradient hooks (a no-op without overlap). May be
        skipped for a step without a batch."""

    def step(self, count: int) -> None:
        """``count`` = samples behind this rank's gradients in this step (0 = none)."""

    def stats(self) -> dict[str, Any]:
        """Strategy-specific figures for the summary (JSON-able)."""

    def close(self) -> None:
        """Release sockets and threads; idempotent."""

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The rank-local optimizer whose state checkpoints hold; None when the optimizer
        lives elsewhere (the parameter server)."""


class OrderedWorker:
    """One background thread that runs ``work(i)`` for submitted indices in submission
    order, and lets the submitting thread wait for them with a bounded wait.

    The first exception stops the work (later indices are skipped) and is re-raised,
    the very same object, by :meth:`wait`.
    """

    def __init__(self, name: str, work: Callable[[int], object]) -> None:
        self._name = name
        self._work = work
        self._queue: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._done = 0
        self._submitted = 0
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def error(self) -> BaseException | None:
        with self._cond:
            return self._error

    def submit(self, index: int) -> None:
        """Queue ``work(index)``; the thread starts on first use."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        with self._cond:
            self._submitted += 1
        self._queue.put(index)

    def _run(self) -> None:
        while True:
            index = self._queue.get()
            if index is None:
                return
            with self._cond:
                failed = self._error is not None
            if not failed:
                try:
                    self._work(index)
                except BaseException as exc:  # handed to the waiting thread
                    with self._cond:
                        self._error = exc
            with self._cond:
                self._done += 1
                self._cond.notify_all()

    def wait(self, stall_s: float) -> None:
        """Wait until every submitted index is done; raise the work's first error.

        The wait is bounded by progress: ``TimeoutError`` if no index finishes within
        ``stall_s`` seconds (the deadline restarts whenever one does).
        """
        with self._cond:
            done = self._done
            deadline = time.monotonic() + stall_s
            while self._done < self._submitted and self._error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"{self._name}: {self._submitted - self._done} exchanges made no "
                        f"progress in {stall_s:.0f} s"
                    )
                self._cond.wait(min(left, 1.0))
                if self._done != done:
                    done = self._done
                    deadline = time.monotonic() + stall_s
            if self._error is not None:
                raise self._error

    def close(self) -> None:
        """Stop the thread after its current item; idempotent, waits at most briefly
        (a thread blocked on a socket is woken by the mesh closing after this)."""
        if self._closed:
            return
        self._closed = True
        thread = self._thread
        if thread is not None:
            self._queue.put(None)
            if thread is not threading.current_thread():
                thread.join(CLOSE_JOIN_S)


class AllreduceSync:
    """Sample-weighted gradient averaging by ring or tree allreduce, then a local step."""

    def __init__(self, ctx: WorkerContext, model: nn.Module, mesh: Mesh) -> None:
        cfg = ctx.job.config
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        # sparse=True embedding tables take the row path (sparse/exchange.py), not the
        # buckets: binding their gradients into a bucket would densify every step
        sparse = sparse_parameters(model) if cfg.sparse_embeddings == "auto" else []
        self.sparse_params = [p for _, p in sparse]
        sparse_ids = {id(p) for p in self.sparse_params}
        self.optimizer = build_optimizer(
            cfg.optimizer, [p for _, p in named], cfg.lr, dict(cfg.optimizer_kwargs)
        )
        named = [(n, p) for n, p in named if id(p) not in sparse_ids]
        params = [p for _, p in named]
        self.mesh = mesh
        self.timeout = cfg.comm_timeout
        specs = resolve_policy(cfg.compression, [n for n, _ in named])
        device = staging_device(params)  # None on the CPU: the path stays as it was
        self.buckets = GradientBuckets(
            params,
            int(cfg.bucket_mb * (1 << 20)),
            specs,
            host_alloc=device.pinned if device is not None else None,
        )
        self.staging: DeviceStaging | None = None
        if device is None:
            self.buckets.bind_grads()  # gradients live in the buckets: no second copy
        else:
            self.staging = DeviceStaging(
                device, [(b.params, b.grads, b.spec) for b in self.buckets.buckets]
            )
            self.buckets.staging = self.staging
        self.allreduce = make_allreduce(cfg.strategy, mesh, **_options(cfg, mesh))
        # the tree sends a whole bucket per message: split buckets over the frame cap
        self._plain = PiecewiseAllreduce(self.allreduce, mesh.max_frame_bytes)
        # one reducer (with its per-bucket state) per distinct compressed spec
        self.reducers: dict[str, CompressedAllreduce] = {}
        for spec in dict.fromkeys(self.buckets.specs):
            comp = build_compressor(spec) if spec != NONE else None
            if comp is not None:
                algo = self.allreduce
                assert isinstance(algo, RingAllreduce | TreeAllreduce)
                self.reducers[spec] = CompressedAllreduce(
                    comp, algo, seed=cfg.seed, path=cfg.compression_path
                )
        self._per_bucket = [self.reducers.get(s) for s in self.buckets.specs]
        # the rows' values go through the compressor the policy gives each table's name
        # (sparse/row_codec.py); the row ids are delta-coded whatever it says
        self.rows: SparseRowExchange | None = None
        if sparse:
            gather = self.allreduce
            assert isinstance(gather, RingAllreduce | TreeAllreduce)
            self.rows = SparseRowExchange(
                sparse,
                self._plain,
                gather,
                mesh,
                cfg.sparse_density,
                specs=row_specs(cfg.compression, [n for n, _ in sparse]),
                seed=cfg.seed,
            )
        self._stepper: SparseStepper | None = None
        self._bucket_raw = [0] * len(self.buckets.buckets)
        self._bucket_wire = [0] * len(self.buckets.buckets)
        self._total: float | None = None
        self.overlap = bool(cfg.overlap)
        self._worker: OrderedWorker | None = None
        self._ready: GradientReadiness | None = None
        self._begun: int | None = None
        self._launched = 0
        self._is_ready: list[bool] = []
        self._lock = threading.Lock()
        # buckets handed over from a gradient hook (overlapping backward) or by step()
        self.launched_in_backward = 0
        self.launched_after = 0
        self._rank = ctx.rank
        self.set_overlap(self.overlap)

    def set_overlap(self, on: bool) -> None:
        """Switch overlap on or off between steps (the bench compares both in one run)."""
        if self._begun is not None:
            raise RuntimeError("set_overlap between begin_step and step")
        if on and self._worker is None:
            self._worker = OrderedWorker(f"sparktrain-comm-r{self._rank}", self._exchange)
            self._ready = GradientReadiness(
                [b.params for b in self.buckets.buckets], self._on_ready
            )
        self.overlap = on

    def _exchange(self, index: int) -> None:
        """Reduce bucket ``index`` (the communication thread, or the training thread
        without overlap); attributes the mesh's byte counts to the bucket."""
        before = self.mesh.stats.as_dict()
        total = self.buckets.exchange(index, self._plain, self._per_bucket[index])
        after = self.mesh.stats.as_dict()
        self._bucket_raw[index] += after["raw_bytes_sent"] - before["raw_bytes_sent"]
        self._bucket_wire[index] += after["wire_bytes_sent"] - before["wire_bytes_sent"]
        if index == 0:
            self._total = total

    def _on_ready(self, index: int) -> None:
        """Hook callback: bucket ``index`` is complete; launch every bucket whose turn
        has come (in index order only, so all ranks start the same collective)."""
        assert self._worker is not None
        if self.staging is not None:  # the copy to the host overlaps the backward
            self.staging.start(index)
        with self._lock:
            self._is_ready[index] = True
            while self._launched < len(self._is_ready) and self._is_ready[self._launched]:
                self._worker.submit(self._launched)
                self._launched += 1
                self.launched_in_backward += 1

    def begin_step(self, count: int, micro: int = 1) -> None:
        """Arm the gradient hooks for a step of ``count`` samples (overlap only), whose
        gradients hold the sum of ``micro`` micro-batch means (see
        :meth:`GradientBuckets.begin`)."""
        if not self.overlap or self._worker is None or self._ready is None:
            return
        error = self._worker.error
        if error is not None:
            raise error
        self.buckets.begin(count, micro)
        self._total = None
        with self._lock:
            self._begun = count
            self._launched = 0
            self._is_ready = [False] * len(self.buckets.buckets)
        self._ready.arm()

    def step(self, count: int) -> None:
        """Reduce the buckets not yet handed over, wait for all (bounded), average, and
        take the optimizer step; ``count`` as given to :meth:`begin_step`."""
        self.reduce(count)
        if self.rows is None:
            self.optimizer.step()
        else:
            if self._stepper is None:
                self._stepper = SparseStepper(self.optimizer, self.sparse_params)
            self._stepper.step(self.optimizer.step)
        self.optimizer.zero_grad(set_to_none=False)

    def reduce(self, count: int, micro: int = 1) -> None:
        """:meth:`step` without the optimizer step: leaves every rank's gradients
        replaced by their sample-weighted average (for a caller that steps itself, e.g.
        after clipping the averaged gradients); ``micro`` as in :meth:`begin_step`."""
        self._reduce_buckets(count, micro)
        total = self._total
        if self.rows is not None:  # after the buckets: the same order on every rank
            rows_total = self.rows.exchange(count, micro)
            total = rows_total if total is None else total
        if total is None:
            raise RuntimeError("the model has no trainable parameters to exchange")
        self.buckets.finish(total)

    def _reduce_buckets(self, count: int, micro: int = 1) -> None:
        """Run :meth:`_exchange` on every bucket in index order: those no gradient hook
        handed over yet, then wait (bounded) for the communication thread."""
        if not self.overlap or self._worker is None or self._ready is None:
            self.buckets.begin(count, micro)
            self._total = None
            for i in range(len(self.buckets.buckets)):
                self._exchange(i)
        else:
            if self._begun is None:  # no batch, no backward: nothing was armed
                self.begin_step(count, micro)
            elif self._begun != count:
                raise ValueError(f"begin_step({self._begun}) but step({count}) in one step")
            self._ready.disarm()
            with self._lock:
                self._begun = None
                while self._launched < len(self._is_ready):
                    self._worker.submit(self._launched)
                    self._launched += 1
                    self.launched_after += 1
            try:
                self._worker.wait(self.timeout + WAIT_GRACE_S)
            except TimeoutError as exc:
                error = CommError(f"rank {self.mesh.rank}: {exc}")
                raise self.mesh.abort(error) from exc

    def stats(self) -> dict[str, Any]:
        """Bucket and overlap figures; with compression, per-bucket and per-spec bytes
        (``raw`` = what the plain allreduce would have sent, ``wire`` = what was sent)."""
        out: dict[str, Any] = {
            "gradient_elements": self.buckets.num_elements,
            "overlap": self.overlap,
            "buckets": len(self.buckets.buckets),
            "buckets_launched_in_backward": self.launched_in_backward,
        }
        if self.staging is not None:
            out.update(self.staging.stats())
        if self.rows is not None:
            out.update(self.rows.stats())
        if self.reducers:
            paths = {spec: r.path for spec, r in self.reducers.items()}
            out["compression_path"] = (
                next(iter(paths.values())) if len(self.reducers) == 1 else paths
            )
            out["compression_buckets"] = [
                {
                    "index": b.index,
                    "spec": b.spec,
                    "path": self.reducers[b.spec].path if b.spec in self.reducers else "plain",
                    "params": len(b.params),
                    "elements": int(b.grads.numel()),
                    "raw_bytes_sent": self._bucket_raw[b.index],
                    "wire_bytes_sent": self._bucket_wire[b.index],
                }
                for b in self.buckets.buckets
            ]
            out["compression_by_spec"] = by_spec(out["compression_buckets"])
        return out

    def rank_state(self) -> dict[str, Any] | None:
        """This rank's own state for a checkpoint shard: the compressors' per-bucket
        state (residuals, PowerSGD's Q, ...), or None without compression."""
        rows = self.rows.state_dict() if self.rows is not None else {}
        if not self.reducers and not rows:
            return None
        out: dict[str, Any] = {
            "compress": {spec: r.state_dict() for spec, r in self.reducers.items()}
        }
        if rows:
            out["sparse_rows"] = rows
        return out

    def load_rank_state(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`rank_state`'s output of the same rank."""
        saved = state.get("compress", {})
        if set(saved) != set(self.reducers):
            raise ConfigError(
                f"the checkpoint holds compressor state for {sorted(saved)}, this run "
                f"compresses with {sorted(self.reducers)}: resume with the same compression"
            )
        for spec, reducer in self.reducers.items():
            reducer.load_state_dict(saved[spec])
        if self.rows is not None:
            self.rows.load_state_dict(state.get("sparse_rows", {}))

    def close(self) -> None:
        """Unhook the parameters and stop the communication thread."""
        if self._ready is not None:
            self._ready.remove()
        if self._worker is not None:
            self._worker.close()


def rank_state(sync: StepSync) -> dict[str, Any] | None:
    """A sync's per-rank checkpoint state (None: nothing beyond rank 0's checkpoint)."""
    return sync.rank_state() if isinstance(sync, AllreduceSync) else None


def load_rank_state(sync: StepSync, state: dict[str, Any]) -> None:
    """Give a sync back the state :func:`rank_state` saved on this rank."""
    if isinstance(sync, AllreduceSync):
        sync.load_rank_state(state)


def _options(cfg: TrainConfig, mesh: Mesh) -> dict[str, Any]:
    """The ring's pieces stay under the mesh's frame cap (tests shrink it)."""
    if cfg.strategy != "ring":
        return {}
    return {"chunk_bytes": max(8, min(DEFAULT_CHUNK_BYTES, mesh.max_frame_bytes))}


def make_sync(ctx: WorkerContext, model: nn.Module, mesh: Mesh) -> StepSync:
    """The StepSync of the job's strategy (its worker half)."""
    return ctx.job.plugin().worker_sync(ctx, model, mesh)
