"""The stage-start probe behind ``strategy="auto"`` / ``compression="auto"``.

Everything is measured over the mesh's own :class:`~sparktrain.wire.connection.Connection`\\ s,
the ones training then uses, so a shaped link (``link`` profiles) shapes the probe too:

1. **latency** (``alpha``): rank 0 sends a 1-byte token around the ring ``pings`` times
   (after one warm-up lap); one lap is ``p`` hops, so ``alpha = median lap / p``. Each
   hop is a receive then a send in Python, as in the ring allreduce itself.
2. **bandwidth** (``beta``): every rank sends ``transfer_bytes`` to its successor while
   receiving as much from its predecessor, all links at once as in the ring (after a
   1-byte shift so the predecessor has started), ``transfers`` times; the fastest counts
   (load on the machine only ever adds time). A transfer of ``T`` seconds gives
   ``beta = max(T - alpha, T / 2) / bytes``: on loopback latency and transfer are of the
   same order and the plain difference would be noise.
3. **agreement**: one tiny tree allreduce with ``max`` as the reducer over (alpha, T,
   compute time, compressor costs): the slowest link and the slowest rank bound a
   synchronous step, and every rank ends with bitwise equal figures, so every rank's
   :func:`~sparktrain.costmodel.choose` returns the same choice.

Bounded: ``pings + 1`` laps of ``p`` hops and ``transfers`` shifts, each operation under
the connections' socket timeout (a dead peer raises :class:`PeerLostError`, never hangs).
With the defaults that is 4 p tiny hops plus two 256 KiB transfers: well under a second
on loopback, about ``(4 p + 2) * RTT/2 + 2 * 256 KiB / bandwidth`` on a slow link.

Also here: the compute measurements the choice needs (:func:`time_compute` for one
batch's forward and backward, :func:`measure_compressors` for compression costs and wire
ratios, measured once per process) and :func:`resolve_auto`, which the training loop calls.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from sparktrain.compress.base import BucketState, decode_message, encode_message
from sparktrain.compress.registry import build
from sparktrain.costmodel import (
    AUTO_COMPRESSIONS,
    AUTO_STRATEGIES,
    CompressorCost,
    LinkEstimate,
    choose,
)
from sparktrain.data.batch import Batch, forward
from sparktrain.errors import CommError, ConfigError
from sparktrain.task.context import WorkerContext
from sparktrain.task.evaluate import target_like
from sparktrain.wire.frames import KIND_DATA
from sparktrain.wire.mesh import Mesh
from sparktrain.wire.tree import TreeAllreduce

log = logging.getLogger(__name__)

DEFAULT_PINGS = 3
DEFAULT_TRANSFERS = 2
DEFAULT_TRANSFER_BYTES = 256 << 10
MEASURE_MAX_ELEMENTS = 1 << 18
"""Compressors are timed on at most this many elements and scaled linearly beyond."""
_FIELDS_PER_COMPRESSOR = 4


# ---------------------------------------------------------------------- links
def probe_links(
    mesh: Mesh,
    rank: int | None = None,
    world: int | None = None,
    *,
    pings: int = DEFAULT_PINGS,
    transfers: int = DEFAULT_TRANSFERS,
    transfer_bytes: int = DEFAULT_TRANSFER_BYTES,
    compute_s: float = 0.0,
    compressors: Sequence[CompressorCost] = (),
) -> LinkEstimate:
    """Measure alpha and beta on the mesh's ring links; every rank returns the same
    :class:`LinkEstimate` (maximum over ranks of each figure, ``compute_s`` and the
    ``compressors``' costs included). Every rank must call it with the same arguments
    (``compute_s`` and the compressor timings may differ; the list of specs may not)."""
    rank = mesh.rank if rank is None else rank
    world = mesh.world_size if world is None else world
    if rank != mesh.rank or world != mesh.world_size:
        raise ConfigError(
            f"probe_links got rank {rank}/{world} for a mesh of rank {mesh.rank}/{mesh.world_size}"
        )
    if pings < 1 or transfers < 1 or transfer_bytes < 1:
        raise ConfigError("probe_links needs pings >= 1, transfers >= 1, transfer_bytes >= 1")
    started = time.perf_counter()
    if world == 1:
        return LinkEstimate(0.0, 0.0, 1, compute_s, tuple(compressors), 0.0)
    try:
        alpha_local = _lap_latency(mesh, pings)
        transfer_local = _shift_time(mesh, transfers, transfer_bytes)
        figures = np.array(
            [alpha_local, transfer_local, compute_s, *_pack(compressors)], dtype=np.float64
        )
        TreeAllreduce(mesh).allreduce_(figures, add=_maximum)
    except CommError as exc:
        failure = mesh.abort(exc)
        if failure is exc:
            raise
        raise failure from exc
    alpha, transfer, compute = (float(v) for v in figures[:3])
    beta = max(transfer - alpha, transfer / 2) / transfer_bytes
    return LinkEstimate(
        alpha_s=alpha,
        beta_s_per_byte=beta,
        world=world,
        compute_s=compute,
        compressors=_unpack(compressors, figures[3:]),
        probe_s=time.perf_counter() - started,
    )


def _maximum(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """The agreement's reducer: commutative, exact, so every rank gets the same bits."""
    np.maximum(a, b, out=out)


def _ring_connections(mesh: Mesh) -> tuple[Any, Any, int]:
    r, n = mesh.rank, mesh.world_size
    nxt, prv = (r + 1) % n, (r - 1) % n
    mesh.connect_all((nxt, prv))
    return mesh.connection(nxt), mesh.connection(prv), nxt


def _lap_latency(mesh: Mesh, pings: int) -> float:
    """Rank 0: median time of a 1-byte token's lap around the ring, per hop; others 0."""
    send, recv, _ = _ring_connections(mesh)
    token = np.zeros(1, dtype=np.uint8)
    box = np.empty(1, dtype=np.uint8)
    laps = []
    for _ in range(pings + 1):  # the first lap warms both ends up
        if mesh.rank == 0:
            t0 = time.perf_counter()
            send.send_array(token, KIND_DATA)
            recv.recv_into(box, KIND_DATA)
            laps.append(time.perf_counter() - t0)
        else:
            recv.recv_into(box, KIND_DATA)
            send.send_array(token, KIND_DATA)
    return statistics.median(laps[1:]) / mesh.world_size if mesh.rank == 0 else 0.0


def _shift_time(mesh: Mesh, transfers: int, nbytes: int) -> float:
    """Fastest time to receive ``nbytes`` from the predecessor while sending as much to
    the successor (the background sender keeps both directions flowing)."""
    send, recv, nxt = _ring_connections(mesh)
    token = np.zeros(1, dtype=np.uint8)
    box = np.empty(1, dtype=np.uint8)
    block = np.zeros(nbytes, dtype=np.uint8)
    inbox = np.empty(nbytes, dtype=np.uint8)
    sender = mesh.sender(nxt)
    times = []
    for _ in range(transfers):
        send.send_array(token, KIND_DATA)  # the predecessor has reached this round
        recv.recv_into(box, KIND_DATA)
        t0 = time.perf_counter()
        sender.put(block, KIND_DATA)
        recv.recv_into(inbox, KIND_DATA)
        times.append(time.perf_counter() - t0)
        sender.flush()
    return min(times)


def _pack(compressors: Sequence[CompressorCost]) -> list[float]:
    out: list[float] = []
    for c in compressors:
        out += [c.ratio, float(c.calls), c.fixed_s_per_elem, c.per_peer_s_per_elem]
    return out


def _unpack(
    compressors: Sequence[CompressorCost], values: np.ndarray
) -> tuple[CompressorCost, ...]:
    out = []
    for i, c in enumerate(compressors):
        ratio, calls, fixed, per_peer = (
            float(v) for v in values[i * _FIELDS_PER_COMPRESSOR : (i + 1) * _FIELDS_PER_COMPRESSOR]
        )
        out.append(
            dataclasses.replace(
                c,
                ratio=ratio,
                calls=int(calls),
                fixed_s_per_elem=fixed,
                per_peer_s_per_elem=per_peer,
            )
        )
    return tuple(out)


# ---------------------------------------------------------------------- compute
def time_compute(
    model: nn.Module,
    loss_fn: Callable[..., torch.Tensor],
    x: torch.Tensor | Batch,
    y: torch.Tensor,
    repeats: int = 2,
) -> float:
    """Fastest of ``repeats`` forward + backward passes on ``(x, y)`` (after one warm-up;
    the minimum, because load elsewhere on the machine only ever adds time).

    Runs in eval mode (no dropout draws from torch's RNG, no batch-norm statistics
    updated) and leaves every gradient unset, so training starts exactly as it would
    have without the measurement.
    """
    if len(x) == 0:
        return 0.0
    was_training = model.training
    model.eval()
    times = []
    try:
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            out = forward(model, x) if isinstance(x, Batch) else model(x)
            loss_fn(out, target_like(y, out)).backward()
            if i:
                times.append(time.perf_counter() - t0)
    finally:
        for p in model.parameters():
            p.grad = None
        model.train(was_training)
    return min(times)


def measure_compressors(
    specs: Sequence[str],
    elements: int,
    shapes: Sequence[tuple[int, ...]] = (),
    repeats: int = 3,
) -> tuple[CompressorCost, ...]:
    """Time each compressor on ``min(elements, MEASURE_MAX_ELEMENTS)`` random values
    (``shapes`` are the parameter shapes, used when all of them fit) and measure the
    bytes it puts in the collective; the fastest of ``repeats`` timings counts. Cached
    per process: the figures are per element."""
    numel = max(1, min(int(elements), MEASURE_MAX_ELEMENTS))
    fits = bool(shapes) and sum(math.prod(s) for s in shapes) == numel
    key_shapes = tuple(tuple(int(d) for d in s) for s in shapes) if fits else ()
    return tuple(_measure(spec, numel, key_shapes, repeats) for spec in specs)


@functools.lru_cache(maxsize=64)
def _measure(
    spec: str, numel: int, shapes: tuple[tuple[int, ...], ...], repeats: int
) -> CompressorCost:
    comp = build(spec)
    if comp is None:
        raise ConfigError("compression 'none' costs nothing to measure")
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    state = BucketState(shapes=shapes)
    if comp.summable:
        calls = 0
        wire = 0

        def count(buf: np.ndarray, add: Any = None) -> None:  # a world of one: no-op SUM
            nonlocal calls, wire
            calls += 1
            wire += buf.nbytes

        times = []
        for i in range(repeats + 1):
            calls = wire = 0
            t0 = time.perf_counter()
            comp.allreduce(x, state, count)  # type: ignore[attr-defined]
            if i:
                times.append(time.perf_counter() - t0)
            state.step += 1
        return CompressorCost(
            spec=spec,
            summable=True,
            ratio=4 * numel / max(wire, 1),
            calls=max(calls, 1),
            fixed_s_per_elem=min(times) / numel,
        )
    t_compress, t_add = [], []
    blob_bytes = 0
    acc = torch.zeros(numel)
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        payload, ctx = comp.compress(x, state)
        blob = encode_message(payload, ctx, 1.0)
        t1 = time.perf_counter()
        part, part_ctx, _ = decode_message(blob, numel)
        comp.add_into(acc, part, part_ctx)
        t2 = time.perf_counter()
        if i:
            t_compress.append(t1 - t0)
            t_add.append(t2 - t1)
        blob_bytes = blob.nbytes
        state.step += 1
    return CompressorCost(
        spec=spec,
        summable=False,
        ratio=4 * numel / max(blob_bytes, 1),
        calls=1,
        fixed_s_per_elem=min(t_compress) / numel,
        per_peer_s_per_elem=min(t_add) / numel,
    )


# ---------------------------------------------------------------------- the loop's hook
def needs_auto(strategy: str, compression: Any) -> bool:
    """True when the config leaves the strategy or the compression to the probe."""
    return strategy == "auto" or compression == "auto"


def resolve_auto(
    ctx: WorkerContext,
    mesh: Mesh,
    model: nn.Module,
    loss_fn: Callable[..., torch.Tensor],
    x: torch.Tensor | Batch,
    y: torch.Tensor,
) -> tuple[WorkerContext, dict[str, Any] | None]:
    """Replace ``auto`` in the job's strategy/compression by a measured choice.

    Returns the context to build the StepSync from (``ctx`` itself when nothing is
    ``auto``) and the figures for the stats record (None then). Only what is ``auto``
    is chosen: a fixed strategy or compression stays as configured. Every rank must
    call it at the same point (it runs collectives on ``mesh``).
    """
    cfg = ctx.job.config
    if not needs_auto(cfg.strategy, cfg.compression):
        return ctx, None
    from sparktrain.strategies import registry

    if not registry.get(cfg.strategy).auto_compression:
        raise ConfigError(
            f"compression='auto' is chosen inside the barrier stage for strategy="
            f"{registry.spelled(registry.having('auto_compression'))}; "
            f"with strategy={cfg.strategy!r} give a compressor (e.g. 'fp16') or 'none'"
        )
    started = time.perf_counter()
    params = [p for p in model.parameters() if p.requires_grad]
    elements = sum(p.numel() for p in params)
    model_bytes = float(sum(p.numel() * p.element_size() for p in params))
    strategies = AUTO_STRATEGIES if cfg.strategy == "auto" else (cfg.strategy,)
    table = isinstance(cfg.compression, dict)  # a per-layer policy: modelled uncompressed
    if cfg.compression == "auto":
        specs: list[str] = list(AUTO_COMPRESSIONS)
    elif table or cfg.compression == "none":
        specs = ["none"]
    else:
        specs = [str(cfg.compression)]
    measured = measure_compressors(
        [s for s in specs if s != "none"], elements, [tuple(p.shape) for p in params]
    )
    if isinstance(x, Batch):  # already one batch
        compute = time_compute(model, loss_fn, x, y)
    else:
        batch = min(cfg.batch_size, len(x))
        compute = time_compute(model, loss_fn, x[:batch], y[:batch])
    measured_at = time.perf_counter()
    estimate = probe_links(mesh, compute_s=compute, compressors=measured)
    choice = choose(
        estimate,
        model_bytes,
        ctx.world_size,
        strategies=strategies,
        compressions=specs,
        bucket_bytes=cfg.bucket_mb * (1 << 20),
    )
    resolved = cfg.replace(
        strategy=choice.strategy,
        compression=cfg.compression if table else choice.compression,
    )
    new_ctx = dataclasses.replace(ctx, spec=dataclasses.replace(ctx.job, config=resolved))
    figures = {
        "asked": {"strategy": cfg.strategy, "compression": cfg.compression},
        **choice.as_dict(),
        "compression": resolved.compression,
        "model_bytes": model_bytes,
        "probe": estimate.as_dict(),
        # local measurements (compressors cached per process, one batch's compute), then
        # the probe, whose first lap also waits for the slowest rank to arrive
        "measure_s": measured_at - started,
        "decide_s": time.perf_counter() - started,
    }
    if ctx.rank == 0:
        log.info("auto: %s + %s (%s)", choice.strategy, resolved.compression, choice.reason)
    return new_ctx, figures
