"""What a training run gives back, and how it travels: the task output rows, the state
codec that carries trained tensors from ranks to the driver without pickle, a model's
weights as weights-only ``torch.save`` bytes, and the summary every barrier-stage run
reports (keys: docs/summary.md).

This module sits at the bottom of the house (it imports only torch and the standard
library): the strategies, the stage runner, the pipeline and the rounds driver all build
their results here, and executor code encodes its state here.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from sparktrain.errors import DataError, WorkerError
from sparktrain.redact import redact_values

if TYPE_CHECKING:
    from torch import nn

    from sparktrain.config import TrainConfig


@dataclass
class Record:
    """One output row of a task: ``kind`` is ``stats``, ``meta`` or ``state``."""

    rank: int
    kind: str
    seq: int
    data: bytes


@dataclass
class TrainResult:
    """What :meth:`Trainer.fit` returns: the trained module (rank 0's weights, on the
    driver), the per-epoch history and the run's summary (see docs/summary.md for the keys).

    The summary holds no credentials: the userinfo of every URI in it (the config's
    ``mlflow_tracking_uri``, say) is removed, secret query values are masked
    (:func:`sparktrain.redact.redact_values`), in place."""

    model: nn.Module
    history: list[dict[str, Any]]
    summary: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # in place: a builder that still holds the dict (to hand it to the listeners,
        # to print it) holds the redacted one
        self.summary.update(redact_values(self.summary))

    def save_summary(self, path: str | Path) -> None:
        """Write the summary as pretty JSON."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.summary, indent=2) + "\n")


# --------------------------------------------------------------------------- state codec
def state_records(
    rank: int,
    tensors: Iterable[tuple[str, torch.Tensor]],
    meta: dict[str, Any],
    chunk_bytes: int,
) -> Iterator[Record]:
    """Named tensors as raw bytes in chunks plus one JSON ``meta`` record holding their
    layout (and ``meta``'s own keys); no pickle. For jobs without a state receiver
    (thread harnesses, benchmarks); :func:`load_state_records` is the other end."""
    layout = []
    blobs = []
    offset = 0
    for name, tensor in tensors:
        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        layout.append(
            {
                "name": name,
                "dtype": str(tensor.dtype).removeprefix("torch."),
                "shape": list(tensor.shape),
                "offset": offset,
                "nbytes": len(raw),
            }
        )
        blobs.append(raw)
        offset += len(raw)
    yield Record(rank, "meta", 0, json.dumps({**meta, "layout": layout, "nbytes": offset}).encode())
    state = b"".join(blobs)
    for seq, start in enumerate(range(0, len(state), chunk_bytes)):
        yield Record(rank, "state", seq, state[start : start + chunk_bytes])


def load_state_records(
    records: Sequence[Record], rank: int, meta: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """The tensors one rank sent with :func:`state_records`, by name."""
    chunks = sorted(
        (r for r in records if r.kind == "state" and r.rank == rank), key=lambda r: r.seq
    )
    blob = b"".join(r.data for r in chunks)
    if len(blob) != meta["nbytes"]:
        raise WorkerError(
            f"rank {rank}'s model state truncated: got {len(blob)} of {meta['nbytes']} bytes"
        )
    state = {}
    for item in meta["layout"]:
        dtype = getattr(torch, item["dtype"])
        raw = bytearray(blob[item["offset"] : item["offset"] + item["nbytes"]])
        tensor = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
        state[item["name"]] = tensor.reshape(item["shape"])
    return state


def state_to_bytes(state: dict[str, torch.Tensor]) -> bytes:
    """A state_dict as ``torch.save`` bytes, tensors detached, on the CPU and contiguous:
    how tree_aggregate ships the driver's model to the executors and how the ml models
    store their weights."""
    buffer = io.BytesIO()
    torch.save({k: v.detach().cpu().contiguous() for k, v in state.items()}, buffer)
    return buffer.getvalue()


def state_from_bytes(blob: bytes, where: str = "the model state") -> dict[str, torch.Tensor]:
    """Inverse of :func:`state_to_bytes`, with ``weights_only=True``: no user code runs."""
    try:
        state = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise DataError(f"{where} is not a readable torch weights file: {exc}") from exc
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise DataError(f"{where} does not hold a state_dict (names -> tensors)")
    return state


def assemble(
    model: nn.Module, records: list[Record], cfg: TrainConfig, wall_s: float, stage_s: float
) -> TrainResult:
    """Load rank 0's state into the driver's model (unless it was streamed there) and
    build the data-parallel run's result."""
    stats = sorted(
        (json.loads(r.data) for r in records if r.kind == "stats"), key=lambda s: s["rank"]
    )
    metas = [r for r in records if r.kind == "meta"]
    if len(metas) != 1 or len(stats) != cfg.num_workers:
        raise WorkerError(
            f"the training stage returned {len(stats)} of {cfg.num_workers} worker reports "
            f"and {len(metas)} model states; this is a bug, please report it"
        )
    meta = json.loads(metas[0].data)
    if not meta.get("streamed"):  # else the state receiver already wrote it into model
        model.load_state_dict(load_state_records(records, 0, meta))

    summary = stage_summary(
        cfg,
        model,
        stats,
        meta,
        world_size=cfg.num_workers,
        wall_s=wall_s,
        stage_s=stage_s,
        replicas_in_sync=len({s["param_digest"] for s in stats}) == 1,
    )
    return TrainResult(model=model, history=summary["history"], summary=summary)


# --------------------------------------------------------------------------- summaries
def stage_summary(
    cfg: TrainConfig,
    model: nn.Module,
    stats: list[dict[str, Any]],
    meta: dict[str, Any],
    *,
    world_size: int,
    wall_s: float,
    stage_s: float,
    replicas_in_sync: bool,
) -> dict[str, Any]:
    """The summary keys every barrier-stage run reports, from the per-rank ``stats``
    records and rank 0's ``meta`` (history, metric name); see docs/summary.md."""
    history = meta["history"]
    last = history[-1]
    train_s = max(s["train_s"] for s in stats)
    train_samples = sum(s["train_rows"] for s in stats)
    return {
        **stats_summary(cfg, stats, world_size=world_size, wall_s=wall_s, stage_s=stage_s),
        "epochs": cfg.epochs,
        "epochs_run": len(history),  # fewer when early stopping stopped the run
        "train_samples": train_samples,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "final_loss": last["loss"],
        "metric_name": meta["metric_name"],
        "metric_value": last["metric"],
        "train_s": train_s,
        "samples_per_s": train_samples * cfg.epochs / train_s if train_s > 0 else 0.0,
        "restarts": 0,
        "replicas_in_sync": replicas_in_sync,
        # each epoch's figures: loss, the metric (also by its name), the config's extra
        # metrics, the learning rate, and where early stopping stopped the run
        "history": [
            {k: v for k, v in h.items() if k not in ("type", "metric_name")} for h in history
        ],
        **({"early_stopping": meta["early_stopping"]} if "early_stopping" in meta else {}),
        # strategy/compression "auto": what the stage-start probe chose and why
        **({"auto": stats[0]["auto"]} if "auto" in stats[0] else {}),
        # per rank: the GPUs Spark assigned it, the one it pinned, the device it used
        **(
            {"placement": [{k: s[k] for k in ("rank", "gpus", "gpu", "device")} for s in stats]}
            if "device" in stats[0]
            else {}
        ),
    }


def stats_summary(
    cfg: TrainConfig,
    stats: list[dict[str, Any]],
    *,
    world_size: int,
    wall_s: float,
    stage_s: float,
) -> dict[str, Any]:
    """The keys every barrier stage reports, a fit's or :func:`sparktrain.run`'s, from
    the per-rank ``stats`` records alone: what ran where, the time and the bytes."""
    comm = [s["comm"] for s in stats]
    bytes_sent = sum(c["raw_bytes_sent"] for c in comm)
    wire_bytes = sum(c["wire_bytes_sent"] for c in comm)
    return {
        "strategy": cfg.strategy,
        "compression": cfg.compression,
        "world_size": world_size,
        "train_rows_per_worker": [s["train_rows"] for s in stats],
        "steps_per_epoch": stats[0]["steps_per_epoch"],
        "wall_s": wall_s,
        "stage_s": stage_s,
        "comm_s": max(s["comm_s"] for s in stats),
        "bytes_sent": bytes_sent,
        "wire_bytes": wire_bytes,
        "compression_ratio": bytes_sent / wire_bytes if wire_bytes else 1.0,
        # each rank's process peak (VmHWM; ranks sharing a process report one figure)
        "peak_rss_bytes_per_worker": [s.get("peak_rss_bytes", 0) for s in stats],
        **data_summary(stats),
        "config": cfg.to_dict(),
        **sync_summary(stats),
    }


def data_summary(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """Where the ranks held their rows and what waiting for batches cost (docs/data.md)."""
    paths = {s.get("data_path", "memory") for s in stats}
    return {
        "data_path": "spilled" if "spilled" in paths else "memory",
        "data_spilled_bytes": sum(int(s.get("spilled_bytes", 0)) for s in stats),
        "data_wait_s": max(float(s.get("data_wait_s", 0.0)) for s in stats),
        # the largest anonymous memory sampled per rank: heap and arrays, not the page
        # cache that backs a spilled partition's memory map
        "peak_anon_bytes_per_worker": [int(s.get("peak_anon_bytes", 0)) for s in stats],
    }


def sync_summary(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """Overlap and per-spec compression figures from the ranks' StepSync stats (only the
    keys the strategy reported)."""
    out: dict[str, Any] = {}
    first = stats[0]
    for key in ("overlap", "compression_path", "precision", "skipped_steps"):
        if key in first:
            out[key] = first[key]
    if first.get("shard_optimizer"):  # ZeRO-1: whose optimizer state is where
        out["shard_optimizer"] = True
        out["optimizer_state_elements_per_worker"] = [
            int(s.get("optimizer_state_elements", 0)) for s in stats
        ]
    launched = [s[k] for s in stats for k in ("buckets_launched_in_backward",) if k in s]
    if launched:
        out["buckets_launched_in_backward"] = sum(launched)
    buckets = [b for s in stats for b in s.get("compression_buckets", [])]
    if buckets:
        out["compression_by_spec"] = by_spec(buckets)
    out.update(sparse_summary(stats))
    return out


def sparse_summary(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """The row path's figures (docs/sparse.md), when a rank reported sparse tables:
    rank 0's view of each step (every rank sees the same union and takes the same way)
    and the bytes of all ranks."""
    first = stats[0]
    if "sparse_tables" not in first:
        return {}
    return {
        "sparse_tables": first["sparse_tables"],
        "sparse_rows_per_step": first["sparse_rows_per_step"],
        "sparse_row_way": first["sparse_row_way"],
        "sparse_dense_way": first["sparse_dense_way"],
        "sparse_bytes_sent": sum(int(s.get("sparse_raw_bytes_sent", 0)) for s in stats),
        "sparse_wire_bytes": sum(int(s.get("sparse_wire_bytes_sent", 0)) for s in stats),
        # the row messages' bytes in the uncompressed format (int64 ids, raw rows) over
        # their bytes as sent (delta-coded ids, compressed values): the same on every rank
        "sparse_rows_ratio": (
            first.get("sparse_plain_message_bytes", 0) / first["sparse_message_bytes"]
            if first.get("sparse_message_bytes")
            else None
        ),
        "sparse_compression": first.get("sparse_compression", {}),
    }


def by_spec(buckets: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per-bucket compression figures summed per spec, with the spec's byte ratio
    (what the plain allreduce would have sent / what went on the wire). Works on one
    rank's ``compression_buckets`` or on all ranks' concatenated: bytes add up over the
    rows, buckets and elements count each bucket index once."""
    out: dict[str, dict[str, Any]] = {}
    seen: set[tuple[str, int]] = set()
    for b in buckets:
        s = out.setdefault(
            b["spec"],
            {
                "path": b["path"],
                "buckets": 0,
                "elements": 0,
                "raw_bytes_sent": 0,
                "wire_bytes_sent": 0,
            },
        )
        key = (b["spec"], b.get("index", len(seen)))
        if key not in seen:
            seen.add(key)
            s["buckets"] += 1
            s["elements"] += b["elements"]
        s["raw_bytes_sent"] += b["raw_bytes_sent"]
        s["wire_bytes_sent"] += b["wire_bytes_sent"]
    for s in out.values():
        s["ratio"] = s["raw_bytes_sent"] / s["wire_bytes_sent"] if s["wire_bytes_sent"] else 1.0
    return out
