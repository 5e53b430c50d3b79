"""The parameter server's figures: per-shard counters and the summary's ``ps`` entry.

Each shard counts its requests in :class:`ShardCounters` (under the shard's lock) and
reports them with :func:`shard_figures`; :func:`summarize` adds the shards up into
``summary["ps"]`` and :func:`add_to_summary` puts the server's figures into the run's
summary.

Bytes are counted per direction: *push* is everything the workers send a shard (wire)
against the uncompressed gradient slices their pushes stand for (raw); *pull* is
everything a shard sends back against the uncompressed values/deltas.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sparktrain.config import TrainConfig

STALENESS_BINS = 32  # the histogram keeps staleness 0..31 exactly, the rest as "32+"


@dataclass
class ShardCounters:
    """One shard's request counters."""

    pushes: int = 0
    duplicates: int = 0
    reconnects: int = 0
    rejected: int = 0
    pulls: int = 0
    unchanged_pulls: int = 0
    full_pulls: int = 0
    updates: int = 0
    staleness: Counter[int] = field(default_factory=Counter)
    max_ssp_gap: int = 0
    push_raw_bytes: int = 0  # uncompressed size of the gradient slices received
    push_payload_bytes: int = 0  # their frames on the wire (headers included)
    pull_raw_bytes: int = 0  # uncompressed size of the values/deltas sent
    pull_payload_bytes: int = 0
    rows_pushed: int = 0  # sparse table rows received in pushes (docs/sparse_ps.md)
    rows_pulled: int = 0  # sparse table rows sent in row pulls
    row_pulls: int = 0

    def record_staleness(self, staleness: int) -> None:
        """Count one applied push of ``staleness`` in the histogram."""
        self.staleness[min(staleness, STALENESS_BINS)] += 1


def shard_figures(
    c: ShardCounters,
    comm: dict[str, Any],
    *,
    index: int,
    address: str,
    elements: int,
    nbytes: int,
    version: int,
    applied: int,
    wait_s: dict[int, float],
) -> dict[str, Any]:
    """One shard's figures for the summary; ``comm`` is its connections'
    :meth:`~sparktrain.wire.stats.CommStats.as_dict`, ``wait_s`` its waiting per rank."""
    return {
        "index": index,
        "address": address,
        "elements": elements,
        "bytes": nbytes,
        "version": version,
        "applied": applied,
        "updates": c.updates,
        "pushes": c.pushes,
        "duplicates": c.duplicates,
        "reconnects": c.reconnects,
        "rejected": c.rejected,
        "pulls": c.pulls,
        "unchanged_pulls": c.unchanged_pulls,
        "full_pulls": c.full_pulls,
        "bytes_in": comm["wire_bytes_recv"],
        "bytes_out": comm["wire_bytes_sent"],
        "raw_bytes_out": comm["raw_bytes_sent"],
        "push_raw_bytes": c.push_raw_bytes,
        "push_payload_bytes": c.push_payload_bytes,
        "pull_raw_bytes": c.pull_raw_bytes,
        "pull_payload_bytes": c.pull_payload_bytes,
        "rows_pushed": c.rows_pushed,
        "rows_pulled": c.rows_pulled,
        "row_pulls": c.row_pulls,
        "staleness_hist": dict(sorted(c.staleness.items())),
        "max_ssp_gap": c.max_ssp_gap,
        "wait_s": wait_s,
    }


def summarize(
    shards: list[dict[str, Any]],
    cfg: TrainConfig,
    *,
    world_size: int,
    failure: tuple[int, str] | None,
) -> dict[str, Any]:
    """Per-shard and total figures (``summary["ps"]``) from every shard's
    :func:`shard_figures`: pushes, bytes in/out per direction, staleness, waiting."""
    hist: Counter[int] = Counter()
    for s in shards:
        hist.update(s["staleness_hist"])
    waits: dict[int, float] = {}
    for s in shards:
        for r, w in s["wait_s"].items():
            waits[r] = waits.get(r, 0.0) + w
    n = sum(hist.values())
    out: dict[str, Any] = {
        "mode": cfg.ps_mode,
        "shards": len(shards),
        "staleness_bound": cfg.staleness if cfg.ps_mode == "ssp" else None,
        "staleness_lr": cfg.staleness_lr,
        "pushes": sum(s["pushes"] for s in shards),
        "version": min((s["version"] for s in shards), default=0),
        "applied_pushes": min((s["applied"] for s in shards), default=0),
        "duplicates": sum(s["duplicates"] for s in shards),
        "reconnects": sum(s["reconnects"] for s in shards),
        "rejected": sum(s["rejected"] for s in shards),
        "pulls": sum(s["pulls"] for s in shards),
        "unchanged_pulls": sum(s["unchanged_pulls"] for s in shards),
        "rows_pushed": sum(s["rows_pushed"] for s in shards),
        "rows_pulled": sum(s["rows_pulled"] for s in shards),
        "row_pulls": sum(s["row_pulls"] for s in shards),
        "bytes_in": sum(s["bytes_in"] for s in shards),
        "bytes_out": sum(s["bytes_out"] for s in shards),
        "raw_bytes_out": sum(s["raw_bytes_out"] for s in shards),
        "compression": cfg.compression,
        "push": _direction(shards, "push", "bytes_in"),
        "pull": _direction(shards, "pull", "bytes_out"),
        "staleness_hist": {
            str(k) if k < STALENESS_BINS else f"{k}+": v for k, v in sorted(hist.items())
        },
        "mean_staleness": sum(k * v for k, v in hist.items()) / n if n else 0.0,
        "max_staleness": max(hist, default=0),
        "max_ssp_gap": max((s["max_ssp_gap"] for s in shards), default=0),
        "wait_s_per_rank": [waits.get(r, 0.0) for r in range(world_size)],
        "failure": None if failure is None else {"rank": failure[0], "detail": failure[1]},
        "per_shard": [
            {k: v for k, v in s.items() if k not in ("wait_s", "staleness_hist")}
            | {"wait_s": sum(s["wait_s"].values())}
            for s in shards
        ],
    }
    out["wait_s_total"] = sum(out["wait_s_per_rank"])
    return out


def _direction(shards: list[dict[str, Any]], name: str, wire_key: str) -> dict[str, Any]:
    """One direction's byte figures: ``raw_bytes`` (the uncompressed payloads),
    ``wire_bytes`` (every byte that direction's connections carried: payload frames,
    headers, requests, handshakes), ``payload_bytes`` (the payload frames alone) and
    ``ratio = raw / wire`` (below 1 without compression: headers cost something)."""
    raw = sum(s[f"{name}_raw_bytes"] for s in shards)
    wire = sum(s[wire_key] for s in shards)
    payload = sum(s[f"{name}_payload_bytes"] for s in shards)
    return {
        "raw_bytes": raw,
        "wire_bytes": wire,
        "payload_bytes": payload,
        "ratio": raw / wire if wire else 1.0,
        "payload_ratio": raw / payload if payload else 1.0,
    }


def add_to_summary(summary: dict[str, Any], stats: dict[str, Any]) -> None:
    """Put the server's figures (:func:`summarize`) into a run's summary: ``ps``,
    ``ps_version``, ``ps_applied_pushes``, and the server's sent bytes added to
    ``bytes_sent``/``wire_bytes`` (workers count what they push, the server what it sends
    back, so the totals cover both directions, as the ring's cover every rank's sends)."""
    summary["ps"] = stats
    # no step applied twice: the version counts applications, applied_pushes the
    # distinct step numbers (sync) or pushes (async/ssp) in the ledger
    summary["ps_version"] = stats["version"]
    summary["ps_applied_pushes"] = stats["applied_pushes"]
    summary["bytes_sent"] = summary.get("bytes_sent", 0) + stats["raw_bytes_out"]
    summary["wire_bytes"] = summary.get("wire_bytes", 0) + stats["bytes_out"]
    if summary["wire_bytes"]:
        summary["compression_ratio"] = summary["bytes_sent"] / summary["wire_bytes"]
