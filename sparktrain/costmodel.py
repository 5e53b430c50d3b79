"""The alpha-beta cost model of sparktrain's gradient exchanges, and the ``auto`` choice.

A message of ``m`` bytes between two ranks costs ``alpha + m * beta``: ``alpha`` is the
per-message latency (one way, software overhead included) and ``beta`` the seconds per
byte of one link. Both are *measured* (:func:`sparktrain.task.probe.probe_links` at
stage start, ``sparktrain bench scaling`` for the plots); nothing here is a constant
pretending to be a measurement. ``n`` is the gradient's size in bytes, ``p`` the world.

What each strategy costs per step, derived from what the code does:

- **ring** (:mod:`sparktrain.wire.ring`): reduce-scatter then all-gather, ``p - 1`` steps
  each, every step one segment of ``n / p`` bytes to the next rank while receiving one
  from the previous: ``2 (p - 1) alpha + 2 (p - 1) / p * n beta``.
- **tree** (:mod:`sparktrain.wire.tree`, recursive doubling): with ``q`` the largest
  power of two <= p, ``log2 q`` rounds in which partners swap the whole buffer; when
  ``p > q`` the extra ranks fold in first and get the result back last, two more
  whole-buffer messages: ``(log2 q + 2 [p > q]) (alpha + n beta)``.
- **compressed** (:mod:`sparktrain.compress.collective`): *summable* payloads (fp16,
  bf16, randomk, powersgd) are reduced inside the ring/tree, so the formulas above hold
  with ``n / ratio`` bytes and one latency term per collective call (PowerSGD makes two
  per bucket, plus one for the sample count); the others (int8, topk, sign) are
  *all-gathered*: ring ``(p - 1)(alpha + n / ratio * beta)``, tree ``log2 q`` rounds of
  latency but the same ``(p - 1) n / ratio`` bytes (a folded rank: ``p`` payloads more).
  Their compute is measured too: compress + decode, and for the all-gather one decode
  and add per rank, so it grows with ``p``.
- **ps** (:mod:`sparktrain.strategies.ps`): every worker pushes ``n`` bytes (a request answered by
  an ack) and then pulls ``n`` bytes (a request answered by the values): four one-way
  latencies. All shards live in the driver, so the driver's single link carries ``p n``
  bytes in and ``p n`` out per step; sharding spreads the sockets and the optimizer
  work over threads but not the bandwidth: ``4 alpha + 2 p n beta`` (compressed pushes:
  ``4 alpha + p n beta / ratio + p n beta``; pulls stay exact). The server's optimizer
  time is not modelled.
- **tree_aggregate** (:mod:`sparktrain.strategies.tree_aggregate.driver`): one Spark job
  per round, whose scheduling overhead ``J`` is measured (``bench mllib``'s
  ``round_overhead_s``), plus the broadcast of the weights (a binomial tree,
  ``ceil(log2 p)(alpha + n beta)``) and ``RDD.treeAggregate`` of depth ``d`` (each level
  merges ``ceil(p^(1/d))`` payloads: ``d (alpha + ceil(p^(1/d)) n beta)``).

Gradients travel in buckets of at most ``bucket_mb``: each bucket is one collective, so
the latency terms are paid once per bucket. A step costs ``compute + comm`` (or
``max(compute, comm)`` with ``overlap``), ``compute`` being the measured forward and
backward time of one batch.

:func:`choose` is what ``strategy="auto"`` / ``compression="auto"`` run inside the
barrier stage. It picks among the *barrier allreduce* strategies, ring and tree: the
parameter server must be started in the driver before the stage and ``tree_aggregate``
is not a barrier stage at all, so neither can be switched to once the probe has run
(their costs are still modelled here, for the scaling predictions).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from sparktrain.errors import ConfigError

AUTO_STRATEGIES = ("ring", "tree")
"""What ``strategy="auto"`` chooses from (see the module docstring for why)."""

AUTO_COMPRESSIONS = ("none", "fp16", "int8+ef", "powersgd:2+ef", "topk:0.01+ef")
"""What ``compression="auto"`` chooses from, most faithful first: when two are within
``tolerance`` of each other, the earlier one wins (compression costs accuracy)."""

DEFAULT_TOLERANCE = 0.10
"""A more lossy choice must predict a step at least this much faster to be taken."""


@dataclass(frozen=True)
class CompressorCost:
    """What one compressor costs, measured on this machine (see
    :func:`sparktrain.task.probe.measure_compressors`).

    ``ratio`` is raw fp32 bytes over the bytes it puts in the collective; ``calls`` the
    collective calls per bucket (latency terms); ``fixed_s_per_elem`` the compute per
    gradient element paid once per step (compress, decode), ``per_peer_s_per_elem`` the
    compute per element paid once per rank (all-gather: decode and add each payload).
    """

    spec: str
    summable: bool
    ratio: float
    calls: int = 1
    fixed_s_per_elem: float = 0.0
    per_peer_s_per_elem: float = 0.0

    def compute_s(self, elements: int, world: int) -> float:
        """Compression compute per step for ``elements`` gradient values."""
        return elements * (self.fixed_s_per_elem + world * self.per_peer_s_per_elem)


@dataclass(frozen=True)
class LinkEstimate:
    """One measured estimate every rank agrees on (see :mod:`sparktrain.task.probe`).

    ``alpha_s``: one-way latency of one small message; ``beta_s_per_byte``: seconds per
    byte of one link; ``compute_s``: one batch's forward and backward (slowest rank);
    ``compressors``: measured compressor costs; ``probe_s``: what the probe took.
    """

    alpha_s: float
    beta_s_per_byte: float
    world: int = 1
    compute_s: float = 0.0
    compressors: tuple[CompressorCost, ...] = ()
    probe_s: float = 0.0

    @property
    def bandwidth_bytes_per_s(self) -> float:
        """``1 / beta`` (inf for an unmeasured, free link)."""
        return 1.0 / self.beta_s_per_byte if self.beta_s_per_byte > 0 else math.inf

    def as_dict(self) -> dict[str, Any]:
        """JSON-able figures for the summary."""
        out = asdict(self)
        out["compressors"] = [asdict(c) for c in self.compressors]
        bw = self.bandwidth_bytes_per_s
        out["bandwidth_mbit_s"] = bw * 8e-6 if math.isfinite(bw) else None
        return out


@dataclass(frozen=True)
class Choice:
    """What :func:`choose` decided: the strategy, the compression spec, the predicted
    step time, every candidate's prediction and a sentence saying why."""

    strategy: str
    compression: str
    predicted_step_s: float
    reason: str
    candidates: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """JSON-able view for the summary."""
        return asdict(self)


# ---------------------------------------------------------------------- collectives
def _pow2_floor(p: int) -> int:
    return 1 << (p.bit_length() - 1)


def _check(p: int, *values: float) -> None:
    if p < 1:
        raise ConfigError(f"the world size must be >= 1, got {p}")
    if any(v < 0 or math.isnan(v) for v in values):
        raise ConfigError(f"cost-model inputs must be >= 0, got {values}")


def ring_allreduce_s(nbytes: float, p: int, alpha: float, beta: float, calls: int = 1) -> float:
    """Ring allreduce of ``nbytes`` in all (split over ``calls`` collectives):
    ``2 (p - 1) alpha`` per call + ``2 (p - 1) / p * n beta``."""
    _check(p, nbytes, alpha, beta)
    if p == 1:
        return 0.0
    return calls * 2 * (p - 1) * alpha + 2 * (p - 1) / p * nbytes * beta


def tree_rounds(p: int) -> int:
    """Whole-buffer messages on a rank's critical path in :class:`TreeAllreduce`:
    ``log2 q`` swaps, plus fold-in and fold-out when ``p`` is not a power of two."""
    _check(p)
    q = _pow2_floor(p)
    return (q.bit_length() - 1) + (2 if p > q else 0)


def tree_allreduce_s(nbytes: float, p: int, alpha: float, beta: float, calls: int = 1) -> float:
    """Recursive doubling (with folding): ``rounds * (alpha + n beta)``, the latency
    part paid once per call."""
    _check(p, nbytes, alpha, beta)
    rounds = tree_rounds(p)
    return rounds * (calls * alpha + nbytes * beta)


def ring_allgather_s(
    payload_bytes: float, p: int, alpha: float, beta: float, calls: int = 1
) -> float:
    """All-gather around the ring: ``p - 1`` steps of one payload each."""
    _check(p, payload_bytes, alpha, beta)
    return (p - 1) * (calls * alpha + payload_bytes * beta)


def tree_allgather_s(
    payload_bytes: float, p: int, alpha: float, beta: float, calls: int = 1
) -> float:
    """All-gather by recursive doubling: ``log2 q`` rounds of latency, ``q - 1`` payloads
    received; a fold adds one payload in and ``p - 1`` back out (two more latencies)."""
    _check(p, payload_bytes, alpha, beta)
    q = _pow2_floor(p)
    latency = (q.bit_length() - 1) * calls * alpha
    volume = (q - 1) * payload_bytes * beta
    if p > q:
        latency += 2 * calls * alpha
        volume += p * payload_bytes * beta  # one in, p - 1 out, on the folded pair's link
    return latency + volume


def ps_step_s(nbytes: float, p: int, alpha: float, beta: float, push_ratio: float = 1.0) -> float:
    """Parameter-server push + pull: ``4 alpha + p n beta / push_ratio + p n beta``
    (the driver's one link carries every worker's traffic)."""
    _check(p, nbytes, alpha, beta)
    if push_ratio <= 0:
        raise ConfigError(f"push_ratio must be > 0, got {push_ratio}")
    return 4 * alpha + p * nbytes * beta / push_ratio + p * nbytes * beta


def tree_aggregate_round_s(
    nbytes: float, p: int, alpha: float, beta: float, job_overhead_s: float, depth: int = 2
) -> float:
    """One ``tree_aggregate`` round: measured Spark job overhead + broadcast of the
    weights + ``treeAggregate`` of the payloads (see the module docstring)."""
    _check(p, nbytes, alpha, beta, job_overhead_s)
    if depth < 1:
        raise ConfigError(f"depth must be >= 1, got {depth}")
    broadcast = math.ceil(math.log2(p)) * (alpha + nbytes * beta) if p > 1 else 0.0
    fan_in = max(2, math.ceil(p ** (1.0 / depth)))
    aggregate = depth * (alpha + min(fan_in, p) * nbytes * beta)
    return job_overhead_s + broadcast + aggregate


# ---------------------------------------------------------------------- one step
def buckets_for(nbytes: float, bucket_bytes: float) -> int:
    """How many collectives one step's gradients take (``GradientBuckets``)."""
    if bucket_bytes <= 0:
        raise ConfigError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    return max(1, math.ceil(nbytes / bucket_bytes))


def comm_s(
    strategy: str,
    nbytes: float,
    p: int,
    alpha: float,
    beta: float,
    *,
    compressor: CompressorCost | None = None,
    buckets: int = 1,
) -> float:
    """Predicted communication time of one step for a ring/tree/ps exchange of
    ``nbytes`` of fp32 gradients, optionally through ``compressor``."""
    if strategy == "ps":
        return ps_step_s(nbytes, p, alpha, beta, compressor.ratio if compressor else 1.0)
    if strategy not in AUTO_STRATEGIES:
        raise ConfigError(f"comm_s models ring, tree and ps, not {strategy!r}")
    if compressor is None:
        fn = ring_allreduce_s if strategy == "ring" else tree_allreduce_s
        return fn(nbytes, p, alpha, beta, calls=buckets)
    wire = nbytes / compressor.ratio
    if compressor.summable:
        fn = ring_allreduce_s if strategy == "ring" else tree_allreduce_s
        # every bucket makes ``calls`` collectives; bucket 0 one more for the sample count
        body = fn(wire, p, alpha, beta, calls=buckets * compressor.calls)
        return body + fn(8.0, p, alpha, beta)
    gather = ring_allgather_s if strategy == "ring" else tree_allgather_s
    return gather(wire, p, alpha, beta, calls=buckets)


def zero1_comm_s(
    nbytes: float, p: int, alpha: float, beta: float, *, buckets: int = 1, clip: bool = False
) -> tuple[float, float]:
    """``shard_optimizer`` (:mod:`sparktrain.task.sharded`): ``(reduce-scatter,
    after the step)`` seconds. The ring's two halves send the allreduce's bytes,
    ``(p - 1) alpha + (p - 1) / p * n beta`` each per bucket; the reduce-scatter may
    overlap backward, the all-gather of the parameters follows the optimizer step. The
    row count (and, with clipping, the squared norm) take a tree allreduce of 8 bytes."""
    _check(p, nbytes, alpha, beta)
    if p == 1:
        return 0.0, 0.0
    half = buckets * (p - 1) * alpha + (p - 1) / p * nbytes * beta
    small = (1 + int(clip)) * tree_allreduce_s(8.0, p, alpha, beta)
    return half, half + small


def optimizer_memory_bytes(
    params: int, p: int, *, state_per_param: int = 2, itemsize: int = 4, sharded: bool = False
) -> float:
    """Bytes a worker holds for the model's training state: parameters, the gradient
    buckets (the gradients themselves: they are bound to the buckets) and the optimizer
    state (``state_per_param`` tensors per parameter: 2 for Adam's moments, 1 for SGD
    momentum), the latter divided by ``p`` when sharded. Activations, the data and the
    interpreter come on top."""
    _check(p, params, state_per_param, itemsize)
    state = state_per_param * params * itemsize
    return 2 * params * itemsize + (state / p if sharded else state)


def step_s(compute: float, comm: float, overlap: bool = False) -> float:
    """One step: ``compute + comm``, or ``max`` when the exchange overlaps backward."""
    return max(compute, comm) if overlap else compute + comm


def predict_step_s(
    strategy: str,
    estimate: LinkEstimate,
    model_bytes: float,
    world: int,
    *,
    compute_s: float | None = None,
    compressor: CompressorCost | None = None,
    bucket_bytes: float = 25 * (1 << 20),
    overlap: bool = False,
) -> float:
    """Predicted step time: compute + compression compute + communication."""
    compute = estimate.compute_s if compute_s is None else compute_s
    comm = comm_s(
        strategy,
        model_bytes,
        world,
        estimate.alpha_s,
        estimate.beta_s_per_byte,
        compressor=compressor,
        buckets=buckets_for(model_bytes, bucket_bytes),
    )
    if compressor is not None and world > 1:
        compute += compressor.compute_s(int(model_bytes // 4), world)
    return step_s(compute, comm, overlap)


# ---------------------------------------------------------------------- the choice
def choose(
    estimate: LinkEstimate,
    model_bytes: float,
    world: int,
    compute_s: float | None = None,
    *,
    strategies: Sequence[str] = AUTO_STRATEGIES,
    compressions: Sequence[str] | None = None,
    bucket_bytes: float = 25 * (1 << 20),
    overlap: bool = False,
    tolerance: float = DEFAULT_TOLERANCE,
) -> Choice:
    """Pick the strategy and compression with the smallest predicted step time.

    ``strategies`` are ring/tree candidates (one entry = fixed); ``compressions`` are
    specs in order of preference, ``"none"`` first (default: ``"none"`` plus every
    compressor measured in ``estimate``); each must be ``"none"`` or measured in
    ``estimate.compressors``. The strategy costs no accuracy, so the fastest is taken;
    going down the list, a later (more lossy) compressor replaces the pick so far only
    when its best step is more than ``tolerance`` faster. Deterministic: ranks with equal
    inputs reach the same choice.
    """
    if not strategies:
        raise ConfigError("choose() needs at least one candidate strategy")
    for s in strategies:
        if s not in AUTO_STRATEGIES:
            raise ConfigError(
                f"auto chooses among {', '.join(AUTO_STRATEGIES)} (barrier allreduce); "
                f"{s!r} cannot be chosen inside the stage"
            )
    measured = {c.spec: c for c in estimate.compressors}
    specs = list(compressions) if compressions is not None else ["none", *measured]
    if not specs:
        raise ConfigError("choose() needs at least one candidate compression")
    for spec in specs:
        if spec != "none" and spec not in measured:
            raise ConfigError(f"compression {spec!r} was not measured; measure it first")
    compute = estimate.compute_s if compute_s is None else compute_s

    table: dict[str, float] = {}
    best_per_spec: list[tuple[str, str, float]] = []  # (spec, strategy, step)
    for spec in specs:
        comp = measured.get(spec)
        options = []
        for strategy in strategies:
            t = predict_step_s(
                strategy,
                estimate,
                model_bytes,
                world,
                compute_s=compute,
                compressor=comp,
                bucket_bytes=bucket_bytes,
                overlap=overlap,
            )
            table[f"{strategy}/{spec}"] = t
            options.append((t, strategy))
        t, strategy = min(options)  # ties: the first strategy listed
        best_per_spec.append((spec, strategy, t))

    chosen = best_per_spec[0]
    for cand in best_per_spec[1:]:
        if cand[2] < chosen[2] * (1.0 - tolerance):
            chosen = cand
    spec, strategy, predicted = chosen
    reason = _reason(
        estimate, model_bytes, world, compute, strategy, spec, table, specs, strategies, tolerance
    )
    return Choice(strategy, spec, predicted, reason, table)


def _fmt_s(t: float) -> str:
    return f"{t * 1e3:.3g} ms" if t >= 1e-3 else f"{t * 1e6:.3g} us"


def _reason(
    est: LinkEstimate,
    model_bytes: float,
    world: int,
    compute: float,
    strategy: str,
    spec: str,
    table: dict[str, float],
    specs: Sequence[str],
    strategies: Sequence[str],
    tolerance: float,
) -> str:
    bw = est.bandwidth_bytes_per_s
    bw_text = f"{bw * 8e-6:.4g} Mbit/s" if math.isfinite(bw) else "unlimited"
    parts = [
        f"measured alpha {_fmt_s(est.alpha_s)}, bandwidth {bw_text}, compute "
        f"{_fmt_s(compute)}/step; {model_bytes / 1e6:.3g} MB of gradients, {world} workers"
    ]
    if world == 1:
        parts.append("one worker: nothing is exchanged")
        return "; ".join(parts)
    if len(strategies) > 1:
        others = ", ".join(
            f"{s} {_fmt_s(table[f'{s}/{spec}'])}" for s in strategies if s != strategy
        )
        parts.append(f"{strategy} predicts {_fmt_s(table[f'{strategy}/{spec}'])}/step vs {others}")
    if len(specs) > 1:
        base = min(table[f"{s}/none"] for s in strategies) if "none" in specs else None
        comm_none = (base - compute) if base is not None else None
        if spec == "none" and comm_none is not None and comm_none < tolerance * compute:
            parts.append(
                f"communication ({_fmt_s(comm_none)}) is under {tolerance:.0%} of compute: "
                "no compression (it costs accuracy)"
            )
        elif spec == "none":
            parts.append(
                f"no compressor predicts a step more than {tolerance:.0%} faster than uncompressed"
            )
        else:
            ref = f", uncompressed {_fmt_s(base)}" if base is not None else ""
            parts.append(f"{spec} predicts {_fmt_s(table[f'{strategy}/{spec}'])}/step{ref}")
    return "; ".join(parts)
