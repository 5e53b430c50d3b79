"""tree_aggregate's task side: what one partition does in one round (runs on the executors).

Nothing here imports pyspark. A task sees a :class:`RoundSpec` (plain values plus two
broadcast handles, or anything with a ``.value``), its cached :class:`Block` and the
round number, and returns a *contribution* (:mod:`.codec`) that ``RDD.treeAggregate``
sums: ``(payload, stats)`` where ``payload`` is the encoded flat float32 vector

* ``local_steps == 1``: ``n_p * g_p``, the partition's mean-loss gradient over its
  ``n_p`` samples of the round times ``n_p`` (the ring's rule, see ``task/buckets.py``):
  summed and divided by ``N = sum(n_p)`` it is the gradient of the mean loss over the
  round's global mini-batch;
* ``local_steps == k > 1``: ``n_p * (w_p - w)``, the partition's model delta after ``k``
  local optimizer steps times the samples it used; summed and divided by ``N`` it is the
  sample-weighted mean delta (FedAvg),

and ``stats`` a float64 vector ``[samples, loss sum, eval total, eval rows, raw bytes,
encoded bytes, compute s, received bytes]``. The job's first round also sizes the data
(``RoundSpec.size_slots = P``): partition ``p`` writes its train and validation row
counts into slots ``NUM_STATS + p`` and ``NUM_STATS + P + p``, so the sum holds every
partition's sizes and no separate Spark job is needed to learn them.

The model is built once per Python worker process and job (a module-level cache keyed by
the job id); every round only copies the broadcast weights into it. ``seed`` and the
round number are the same on every partition, so compressors' random choices are shared.

Error feedback in tree_aggregate: the residual of partition ``p`` after round ``r`` is
kept in the Python worker that ran it, by ``(p, r)``; round ``r`` starts from the state
of ``(p, r - 1)``, never from its own, so a retried task computes the same contribution.
Spark does not pin partitions to Python workers: when ``(p, r - 1)`` ran elsewhere the
partition starts from a zero residual (the carried error is dropped, not double-counted).
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from sparktrain.builders import (
    build_loss,
    build_model,
    build_optimizer,
    label_dtype,
    resolve_model_fn,
)
from sparktrain.compress.base import BucketState
from sparktrain.compress.feedback import SCALE, WORLD
from sparktrain.compress.registry import install as install_compressors
from sparktrain.config import TrainConfig
from sparktrain.data.partition_data import PartitionData, epoch_batches
from sparktrain.result import state_from_bytes
from sparktrain.strategies.tree_aggregate.codec import (
    COMPUTE_S,
    DOWN_BYTES,
    EVAL_ROWS,
    EVAL_TOTAL,
    LOSS_SUM,
    NUM_STATS,
    RAW_BYTES,
    SAMPLES,
    WIRE_BYTES,
    Contribution,
    PayloadCodec,
    download_compressor,
    make_codec,
    merge,
    zero_stats,
)
from sparktrain.strategies.tree_aggregate.flat import assign, flatten, flatten_grads, num_elements
from sparktrain.strategies.tree_aggregate.task_weights import Download, apply_delta, fetch_mirror
from sparktrain.task.evaluate import evaluate, target_like
from sparktrain.wire.link import emulate_task_transfer
from sparktrain.wire.security import WireSecurity


@dataclass
class Block:
    """One partition's data, converted once and cached by Spark (``MEMORY_AND_DISK``)."""

    index: int
    train: PartitionData
    val: PartitionData


@dataclass(frozen=True)
class RoundSpec:
    """The picklable view of a tree_aggregate job that every round's closure carries.

    ``model_fn``/``model_kwargs`` build the model on the executor (the factory travels in
    the closure, as a barrier job's does) and ``initial_state`` (a broadcast, once per job)
    holds the driver model's state_dict as weights-only ``torch.save`` bytes: nothing is
    unpickled from the driver's bytes. ``task_hook(partition, round)`` is a test seam for
    fault injection, called at the start of each partition's round.
    """

    job_id: str
    config: TrainConfig
    initial_state: Any  # Broadcast[bytes] or bytes (result.state_to_bytes)
    rounds_per_epoch: int
    evaluate_on_validation: bool
    threads: int = 1
    task_hook: Callable[[int, int], None] | None = field(default=None, compare=False)
    # delta+ specs: where a task fetches the round's full mirror, and the job secret
    weights_address: str | None = None
    secret: bytes = field(default=b"", repr=False)
    security: WireSecurity | None = field(default=None, repr=False)  # frame MACs / TLS
    # > 0 only in the sizing round (the job's first): the number of partitions whose row
    # counts the stats carry; that round's rounds_per_epoch is 0 (not known yet)
    size_slots: int = 0
    # the number of partitions whose payloads a round sums (``+ef:local_clip`` scales
    # its clip by 1/sqrt of it)
    partitions: int = 1
    model_fn: Any = field(kw_only=True)  # zero-argument callable or "package.module:function"
    model_kwargs: dict[str, Any] = field(default_factory=dict, kw_only=True)
    # the compressors the driver registered beyond the built-ins, {name: factory}
    # (compress.registry.plugins()); installed in the task before its codecs are built
    compressors: dict[str, Any] = field(default_factory=dict, kw_only=True)

    @property
    def codec(self) -> PayloadCodec:
        return make_codec(self.config.compression)


def _value(handle: Any) -> Any:
    """A broadcast's value, or the object itself (unit tests pass plain values)."""
    return (
        handle.value if hasattr(handle, "value") and not isinstance(handle, np.ndarray) else handle
    )


class _WorkerState:
    """A job's model and loss in one Python worker, plus the current epoch's batch order
    per partition (cheap to rebuild, but not every round)."""

    def __init__(self, spec: RoundSpec) -> None:
        install_compressors(spec.compressors)  # the driver's plug-ins, before the codecs
        self.model = build_model(resolve_model_fn(spec.model_fn, spec.model_kwargs))
        self.model.load_state_dict(
            state_from_bytes(_value(spec.initial_state), where="the driver's model state")
        )
        self.model.train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.loss_fn = build_loss(spec.config.loss, dict(spec.config.loss_kwargs))
        self.orders: dict[int, tuple[int, list[np.ndarray]]] = {}
        self.lock = threading.Lock()
        self.codec = make_codec(spec.config.compression)
        self.comp_states: dict[int, dict[int, BucketState]] = {}
        self.download_comp = download_compressor(spec.config.compression)
        self.mirror: tuple[int, np.ndarray] | None = None  # (seq, weights) for delta+

    def bucket_state(self, spec: RoundSpec, partition: int, round_index: int) -> BucketState:
        """The compressor state for ``(partition, round)``: a copy of the state left by
        ``(partition, round - 1)`` in this process (or a fresh one), so a retry of a round
        starts from the same state as its first attempt."""
        states = self.comp_states.setdefault(partition, {})
        prev = states.get(round_index - 1)
        if prev is not None:
            state = copy.deepcopy(prev)
        else:
            shapes = tuple(tuple(p.shape) for p in self.params)
            state = BucketState(key=0, shapes=shapes, seed=spec.config.seed)
        state.step = round_index  # equal on every partition: shared random choices
        states[round_index] = state
        for r in [r for r in states if r < round_index - 1 or r > round_index]:
            del states[r]
        return state

    def batches(self, spec: RoundSpec, block: Block, epoch: int) -> list[np.ndarray]:
        cached = self.orders.get(block.index)
        if cached is None or cached[0] != epoch:
            cfg = spec.config
            rng = np.random.default_rng([cfg.seed, block.index, epoch]) if cfg.shuffle else None
            cached = (
                epoch,
                list(epoch_batches(block.train.size, cfg.batch_size, rng, cfg.drop_last)),
            )
            self.orders[block.index] = cached
        return cached[1]


_STATES: dict[str, _WorkerState] = {}
_STATES_LOCK = threading.Lock()


def worker_state(spec: RoundSpec) -> _WorkerState:
    """This process's model for the job, built on first use; other jobs' models dropped."""
    with _STATES_LOCK:
        state = _STATES.get(spec.job_id)
        if state is None:
            _STATES.clear()
            state = _STATES[spec.job_id] = _WorkerState(spec)
        return state


def receive_weights(spec: RoundSpec, download: Download, partition: int) -> tuple[np.ndarray, int]:
    """A ``delta+`` round's weights in this Python worker, and the bytes the task had to
    receive for them: the delta on the mirror this worker holds from the previous round,
    else the round's full mirror fetched from the driver (:mod:`.task_weights`)."""
    state = worker_state(spec)
    with state.lock:
        held = state.mirror
        if download.message is None and download.first is not None:  # exact weights
            first = np.asarray(_value(download.first), dtype=np.float32)
            state.mirror = (download.seq, np.array(first, copy=True))
            return state.mirror[1], first.nbytes
        got = 0 if download.message is None else download.message.nbytes
        if held is not None and held[0] == download.seq:  # another partition's task did it
            return held[1], got
        if (
            held is not None
            and held[0] == download.seq - 1
            and download.message is not None
            and state.download_comp is not None
        ):
            apply_delta(state.download_comp, held[1], download.message)
            state.mirror = (download.seq, held[1])
            return held[1], got
        if spec.weights_address is None:
            raise ValueError("a delta+ round without the driver's weights server; this is a bug")
        fresh = fetch_mirror(
            spec.weights_address,
            secret=spec.secret,
            job_id=spec.job_id,
            partition=partition,
            seq=download.seq,
            numel=download.numel,
            timeout=spec.config.comm_timeout,
            security=spec.security,
        )
        state.mirror = (download.seq, fresh)
        return fresh, got + fresh.nbytes


def partition_round(
    spec: RoundSpec,
    weights: np.ndarray,
    block: Block,
    round_index: int,
    train: bool = True,
    evaluate_first: bool = False,
    received_bytes: int | None = None,
) -> Contribution:
    """One partition's contribution to round ``round_index`` (global, from 0), starting
    from ``weights``. With ``evaluate_first`` the metric sums of ``weights`` on the
    partition's evaluation rows ride along (that is the previous epoch's metric).
    ``received_bytes``: what the task received for ``weights`` (default: all of them)."""
    if spec.task_hook is not None:
        spec.task_hook(block.index, round_index)
    torch.set_num_threads(max(1, spec.threads))
    down = weights.nbytes if received_bytes is None else received_bytes
    # Emulated link (wire/link.py), per task: receiving the weights, not counted as compute.
    emulate_task_transfer(spec.config, down, block.index, round_index, 0)
    started = time.perf_counter()
    cfg = spec.config
    state = worker_state(spec)
    stats = zero_stats(spec.size_slots)
    stats[DOWN_BYTES] = down
    if spec.size_slots:  # the sizing round: report this partition's row counts
        if not 0 <= block.index < spec.size_slots:
            raise ValueError(f"partition {block.index} outside the {spec.size_slots} sized ones")
        stats[NUM_STATS + block.index] = block.train.size
        stats[NUM_STATS + spec.size_slots + block.index] = block.val.size
    with state.lock:  # tasks of one job may share a Python worker only one at a time
        assign(state.params, weights)
        if evaluate_first:
            rows = block.val if spec.evaluate_on_validation else block.train
            stats[EVAL_TOTAL], stats[EVAL_ROWS] = evaluate(state.model, rows, cfg.loss)
        vec = None
        if train:
            # the sizing round is round 0 of epoch 0, whatever rounds_per_epoch turns out
            rpe = spec.rounds_per_epoch
            epoch, r = divmod(round_index, rpe) if rpe else (0, 0)
            batches = state.batches(spec, block, epoch)
            mine = batches[r * cfg.local_steps : (r + 1) * cfg.local_steps]
            if not mine:  # this partition's epoch is over: nothing to send
                pass
            elif cfg.local_steps == 1:
                vec = _gradient_sum(state, cfg, block.train, mine, stats)
            else:
                vec = _delta_sum(state, cfg, block.train, mine, weights, stats)
    payload = None
    if vec is not None:
        codec = state.codec
        if codec.compressed:
            with state.lock:
                bstate = state.bucket_state(spec, block.index, round_index)
                bstate.slots[SCALE] = float(stats[SAMPLES])  # vec is n_p times the mean
                bstate.slots[WORLD] = float(spec.partitions)  # the round sums P partitions
                payload = codec.encode(vec, bstate)
        else:
            payload = codec.encode(vec)
        stats[RAW_BYTES] = vec.nbytes
        stats[WIRE_BYTES] = codec.nbytes(payload)
    stats[COMPUTE_S] = time.perf_counter() - started
    emulate_task_transfer(cfg, int(stats[WIRE_BYTES]), block.index, round_index, 1)  # the upload
    return payload, stats


def make_seq_op(
    spec: RoundSpec, weights: Any, round_index: int, train: bool, evaluate_first: bool
) -> Callable[[Contribution | None, Block], Contribution | None]:
    """treeAggregate's seqOp for one round; closes over picklable values only (the spec,
    the weights, their broadcast handle or a delta+ :class:`Download`, and three plain
    values)."""
    codec = spec.codec

    def seq_op(acc: Contribution | None, block: Block) -> Contribution | None:
        if isinstance(weights, Download):
            values, got = receive_weights(spec, weights, block.index)
        else:
            values = _value(weights)
            got = values.nbytes
        mine = partition_round(spec, values, block, round_index, train, evaluate_first, got)
        return merge(acc, mine, codec)

    return seq_op


def _batch(state: _WorkerState, data: PartitionData, idx: np.ndarray, loss: Any) -> torch.Tensor:
    x = data.gather(idx)
    y = torch.from_numpy(data.y[idx]).to(label_dtype(loss))
    out = state.model(x)
    # weighted data: sum w_i l_i / n with driver-normalised weights (builders.Loss)
    result: torch.Tensor = state.loss_fn(out, target_like(y, out), data.weights_at(idx))
    return result


def _gradient_sum(
    state: _WorkerState,
    cfg: TrainConfig,
    data: PartitionData,
    batches: list[np.ndarray],
    stats: np.ndarray,
) -> np.ndarray:
    """``n * grad(mean loss over the n samples)``."""
    for p in state.params:
        p.grad = None
    vec = np.zeros(num_elements(state.params), dtype=np.float32)
    for idx in batches:  # at most one (local_steps == 1)
        loss = _batch(state, data, idx, cfg.loss)
        loss.backward()
        n = len(idx)
        flatten_grads(state.params, vec)
        vec *= n
        stats[SAMPLES] += n
        stats[LOSS_SUM] += float(loss.detach()) * n
    return vec


def _delta_sum(
    state: _WorkerState,
    cfg: TrainConfig,
    data: PartitionData,
    batches: list[np.ndarray],
    weights: np.ndarray,
    stats: np.ndarray,
) -> np.ndarray:
    """``n * (w_after - w)`` after one local optimizer step per batch (fresh optimizer state
    each round, so a retried task recomputes exactly the same delta)."""
    optimizer = build_optimizer(cfg.optimizer, state.params, cfg.lr, dict(cfg.optimizer_kwargs))
    n = 0
    for idx in batches:
        optimizer.zero_grad(set_to_none=True)
        loss = _batch(state, data, idx, cfg.loss)
        loss.backward()
        optimizer.step()
        n += len(idx)
        stats[LOSS_SUM] += float(loss.detach()) * len(idx)
    stats[SAMPLES] += n
    vec = flatten(state.params)
    vec -= weights
    vec *= n
    return vec
