"""Compressor state in and out of checkpoints.

Error-feedback residuals, PowerSGD's warm-start ``Q``, private generators and the step
counters live in one :class:`~sparktrain.compress.base.BucketState` per bucket and per
rank. A resumed run continues exactly only if every rank gets its own state back, so
each rank saves it in its checkpoint shard (see :mod:`sparktrain.checkpoint`).

The encoding holds tensors and plain values only (``torch.load(weights_only=True)``
reads it back): each slot value is a small dict tagged with its type. Work buffers whose
contents never carry over from one step to the next are left out.
"""

from __future__ import annotations

from typing import Any

import torch

from sparktrain.compress.base import BucketState
from sparktrain.compress.int8 import SCRATCH_SLOT
from sparktrain.compress.sign import ABS_SLOT

SCRATCH_SLOTS = frozenset({SCRATCH_SLOT, ABS_SLOT})
"""Work buffers, overwritten before every use: not state."""


def _encode(value: Any, where: str) -> dict[str, Any]:
    if isinstance(value, torch.Tensor):
        return {"type": "tensor", "value": value.detach().clone()}
    if isinstance(value, torch.Generator):
        return {"type": "generator", "value": value.get_state()}
    if isinstance(value, BucketState):
        return {"type": "bucket", "value": dump_state(value)}
    if isinstance(value, list):
        return {"type": "list", "value": [_encode(v, where) for v in value]}
    if isinstance(value, bool | int | float | str) or value is None:
        return {"type": "plain", "value": value}
    raise TypeError(
        f"compressor state slot {where!r} holds a {type(value).__name__}, which checkpoints "
        "cannot store: teach sparktrain.compress.snapshot to encode it"
    )


def _decode(item: dict[str, Any]) -> Any:
    kind, value = item["type"], item["value"]
    if kind == "tensor" or kind == "plain":
        return value
    if kind == "generator":
        gen = torch.Generator()
        gen.set_state(value)
        return gen
    if kind == "bucket":
        return load_state(value)
    if kind == "list":
        return [_decode(v) for v in value]
    raise ValueError(f"unknown compressor state entry {kind!r}")


def dump_state(state: BucketState) -> dict[str, Any]:
    """One bucket's state as tensors and plain values."""
    return {
        "key": state.key,
        "shapes": [list(s) for s in state.shapes],
        "seed": state.seed,
        "step": state.step,
        "stream": state.stream,
        "slots": {
            name: _encode(value, name)
            for name, value in state.slots.items()
            if name not in SCRATCH_SLOTS
        },
    }


def load_state(data: dict[str, Any]) -> BucketState:
    """The inverse of :func:`dump_state`."""
    return BucketState(
        key=int(data["key"]),
        shapes=tuple(tuple(int(d) for d in s) for s in data["shapes"]),
        seed=int(data["seed"]),
        step=int(data["step"]),
        stream=int(data["stream"]),
        slots={name: _decode(item) for name, item in data["slots"].items()},
    )


def dump_states(states: dict[int, BucketState]) -> dict[str, Any]:
    """Every bucket's state, keyed by bucket index (as text)."""
    return {str(index): dump_state(st) for index, st in states.items()}


def load_states(data: dict[str, Any]) -> dict[int, BucketState]:
    """The inverse of :func:`dump_states`."""
    return {int(index): load_state(item) for index, item in data.items()}
