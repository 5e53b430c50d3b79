"""Splitting a model into P consecutive pipeline stages.

The unit of splitting is a top-level child of an ``nn.Sequential`` (a list or tuple of
modules is treated as ``nn.Sequential(*modules)``, so a ``model_fn`` that returns its own
stage modules gets exactly those boundaries when there are P of them). Stages are
balanced by each child's measured forward + backward time on a probe batch; when that
cannot be measured (or ``balance="params"``), by parameter count. The split minimises the
largest stage cost, subject to an optional per-stage parameter-memory cap.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from sparktrain.errors import ConfigError


@dataclass(frozen=True)
class Partition:
    """Stage ``s`` owns children ``bounds[s]:bounds[s + 1]``; ``shapes[s]`` is the
    per-sample shape of the tensor entering stage ``s`` (``shapes[P]``: the output)."""

    bounds: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    costs: tuple[float, ...]  # per child, in the unit of ``balance``
    param_bytes: tuple[int, ...]  # per stage
    balance: str  # "time" or "params"

    @property
    def num_stages(self) -> int:
        return len(self.bounds) - 1

    def owned(self, stage: int) -> range:
        return range(self.bounds[stage], self.bounds[stage + 1])


def as_sequential(model: nn.Module | Sequence[nn.Module]) -> nn.Sequential:
    """The model as an ``nn.Sequential`` whose children are the units of splitting."""
    if isinstance(model, nn.Sequential):
        return model
    if isinstance(model, list | tuple) and all(isinstance(m, nn.Module) for m in model):
        return nn.Sequential(*model)
    raise ConfigError(
        f"pipeline parallelism splits an nn.Sequential (or a list of stage modules); "
        f"model_fn returned {type(model).__name__}: wrap its layers in nn.Sequential"
    )


def param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def boundary_shapes(model: nn.Sequential, width: int) -> list[tuple[int, ...]]:
    """Per-sample shape of the input of every child, then of the model's output."""
    shapes = []
    x = torch.zeros(2, width)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for child in model:
            shapes.append(tuple(x.shape[1:]))
            x = child(x)
    model.train(was_training)
    shapes.append(tuple(x.shape[1:]))
    return shapes


def measure_costs(
    model: nn.Sequential, width: int, batch: int = 64, repeats: int = 3
) -> list[float] | None:
    """Seconds of forward + backward per child on a random probe batch (the fastest of
    ``repeats``); None when it cannot be measured (the caller falls back to params)."""
    costs = []
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(0))
    try:
        for child in model:
            best = float("inf")
            out = None
            for _ in range(repeats):
                inp = x.detach().requires_grad_(True)
                t = time.perf_counter()
                out = child(inp)
                if out.requires_grad:
                    out.float().sum().backward()
                best = min(best, time.perf_counter() - t)
            child.zero_grad(set_to_none=True)
            assert out is not None
            costs.append(best)
            x = out.detach()
    except Exception:  # a child that cannot run on a probe: balance by parameters
        return None
    if not all(c > 0 for c in costs):
        return None
    return costs


def split_costs(
    costs: Sequence[float], sizes: Sequence[int], stages: int, cap_bytes: int | None = None
) -> tuple[int, ...]:
    """Bounds of ``stages`` non-empty consecutive groups minimising the largest group cost,
    every group's ``sizes`` sum at most ``cap_bytes`` (ties: the earliest split)."""
    n = len(costs)
    if stages > n:
        raise ConfigError(
            f"parallelism.pipeline={stages} but the model has only {n} top-level layers to "
            f"split; use at most {n} stages"
        )
    prefix = [0.0]
    sprefix = [0]
    for c, s in zip(costs, sizes, strict=True):
        prefix.append(prefix[-1] + c)
        sprefix.append(sprefix[-1] + s)
    inf = float("inf")
    # best[k][i]: minimal max-cost of splitting the first i children into k groups
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    choice = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                if best[k - 1][j] == inf:
                    continue
                if cap_bytes is not None and sprefix[i] - sprefix[j] > cap_bytes:
                    continue
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i] = cost
                    choice[k][i] = j
    if best[stages][n] == inf:
        largest = max(sizes) / (1 << 20)
        raise ConfigError(
            f"the model cannot be split into {stages} stages of at most "
            f"{(cap_bytes or 0) / (1 << 20):.2f} MiB of parameters each (its largest layer "
            f"alone holds {largest:.2f} MiB); raise max_param_mb or parallelism.pipeline"
        )
    bounds = [n]
    i = n
    for k in range(stages, 0, -1):
        i = choice[k][i]
        bounds.append(i)
    return tuple(reversed(bounds))


def partition(
    model: nn.Module,
    stages: int,
    width: int,
    *,
    balance: str = "time",
    max_param_bytes: int | None = None,
    bounds: Sequence[int] | None = None,
) -> Partition:
    """Split ``model`` into ``stages`` consecutive stages (see the module docstring).

    ``bounds`` fixes the split instead (e.g. a resumed run takes its checkpoint's, as
    measured times may balance differently today); it must cover the model in
    ``stages`` non-empty stages, each under ``max_param_bytes``."""
    seq = as_sequential(model)
    sizes = [param_bytes(child) for child in seq]
    shapes = boundary_shapes(seq, width)
    costs: list[float] | None = None
    used = "params"
    if bounds is not None:
        balance = "params"  # nothing to measure: the costs are only reported
    if balance == "time":
        costs = measure_costs(seq, width)
        if costs is not None:
            used = "time"
    elif balance != "params":
        raise ConfigError(f"pipeline balance {balance!r} unknown: use 'time' or 'params'")
    if costs is None:
        # parameter count, plus a little per layer so that parameter-free layers spread out
        costs = [float(s // 4) + 1.0 for s in sizes]
    if bounds is None:
        bounds = split_costs(costs, sizes, stages, max_param_bytes)
    else:
        bounds = _check_bounds(tuple(bounds), sizes, stages, max_param_bytes)
    per_stage = tuple(sum(sizes[bounds[s] : bounds[s + 1]]) for s in range(stages))
    return Partition(
        bounds=tuple(bounds),
        shapes=tuple(shapes[b] for b in bounds),
        costs=tuple(costs),
        param_bytes=per_stage,
        balance=used,
    )


def _check_bounds(
    bounds: tuple[int, ...], sizes: Sequence[int], stages: int, cap_bytes: int | None
) -> tuple[int, ...]:
    """``bounds`` if they split ``len(sizes)`` layers into ``stages`` non-empty stages
    under the cap, else a ConfigError saying why."""
    n = len(sizes)
    ordered = all(a < b for a, b in itertools.pairwise(bounds))
    if len(bounds) != stages + 1 or bounds[0] != 0 or bounds[-1] != n or not ordered:
        raise ConfigError(
            f"stage bounds {list(bounds)} do not split the model's {n} top-level layers "
            f"into {stages} non-empty stages: give {stages + 1} increasing bounds from 0 to {n}"
        )
    for s in range(stages):
        held = sum(sizes[bounds[s] : bounds[s + 1]])
        if cap_bytes is not None and held > cap_bytes:
            raise ConfigError(
                f"stage {s} (layers {bounds[s]}:{bounds[s + 1]}) holds {held / (1 << 20):.2f} "
                f"MiB of parameters, over max_param_mb={cap_bytes / (1 << 20):g}"
            )
    return bounds
