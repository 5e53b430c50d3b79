"""The one batch structure: what the training loop, evaluation and ``transform`` read.

A :class:`Batch` holds, for ``n`` rows:

- ``inputs``: model argument → tensor, in the layout's order. Dense columns are
  ``(n, *shape)`` in their column's dtype (``(n,)`` for a scalar column); ragged columns
  ``(n, longest)`` padded with zeros; binary columns what their ``decode`` made, stacked
  (or what their ``collate`` made of the decoded rows);
- ``masks``: for each ragged column (and each collate that returns one), a ``(n,
  longest)`` bool tensor, ``True`` at real values;
- ``labels``: ``(n,)`` for a scalar label, ``(n, k)`` for ``k`` labels a row, float64 as
  stored (the loop casts them for its loss); ``None`` where there are none (``transform``);
- ``weights``: the rows' float32 sample weights, or ``None`` when unweighted.

:func:`forward` calls the model the way the layout says: ``model(x)``, ``model(a, b)`` or
``model(a=..., b=...)``. A column's mask is passed as the keyword argument
``<key>_mask`` when the model's ``forward`` has a parameter of that name (or takes
``**kwargs``); a model that pads with ``padding_idx`` and needs no mask simply leaves the
parameter out.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from sparktrain.builders import import_callable
from sparktrain.data.columns import BINARY, RAGGED, Column, Hook, Layout
from sparktrain.errors import ConfigError, DataError

_TORCH_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
}


@dataclass
class Batch:
    """Tensors of one mini-batch (see the module docstring)."""

    inputs: dict[str, torch.Tensor]
    call: str = "single"
    masks: dict[str, torch.Tensor] = field(default_factory=dict)
    labels: torch.Tensor | None = None
    weights: torch.Tensor | None = None

    def __len__(self) -> int:
        first = next(iter(self.inputs.values()))
        return int(first.shape[0])

    @property
    def y(self) -> torch.Tensor:
        """The labels (an error for a batch without them, e.g. in ``transform``)."""
        if self.labels is None:
            raise KeyError("this batch has no labels")
        return self.labels

    @property
    def x(self) -> torch.Tensor:
        """The one input of a single-column batch (``batch.inputs[key]`` otherwise)."""
        if len(self.inputs) != 1:
            raise KeyError(
                f"this batch has {len(self.inputs)} inputs ({', '.join(self.inputs)}): "
                "read batch.inputs[name]"
            )
        return next(iter(self.inputs.values()))

    def to(self, device: torch.device | str) -> Batch:
        """The same batch on ``device``."""

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        return Batch(
            {k: v.to(device, non_blocking=True) for k, v in self.inputs.items()},
            self.call,
            {k: v.to(device, non_blocking=True) for k, v in self.masks.items()},
            move(self.labels),
            move(self.weights),
        )


def torch_dtype(name: str) -> torch.dtype:
    return _TORCH_DTYPES[name]


def resolve_hook(hook: Hook | None, what: str) -> Callable[..., Any] | None:
    """A ``decode``/``collate``: a callable as it is, ``"module:function"`` imported."""
    if hook is None or callable(hook):
        return hook
    if isinstance(hook, str):
        return import_callable(hook, what=what)
    raise ConfigError(f"{what} must be 'module:function' or a callable, got {hook!r}")


class Collator:
    """Turns a column's gathered rows into the batch's tensors; built once per worker
    (hooks imported once), used from the prefetch thread."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self._decode = {c.key: resolve_hook(c.decode, f"decode[{c.key!r}]") for c in layout.columns}
        self._collate = {
            c.key: resolve_hook(c.collate, f"collate[{c.key!r}]") for c in layout.columns
        }

    def column(
        self, column: Column, rows: Any, partition: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(tensor, mask or None) of one column's gathered rows: a dense ``ndarray``, or
        a list of per-row arrays (ragged) or ``bytes`` (binary)."""
        if column.kind == BINARY:
            rows = [self._decoded(column, value, partition) for value in rows]
        collate = self._collate[column.key]
        if collate is not None:
            if column.kind == RAGGED:
                # a collate gets rows of its own: the store's are views of its chunks, which
                # a collate writing in place would change for every later epoch (in memory)
                # or crash on (a read-only spill map)
                rows = [np.array(r) for r in rows]
            return _from_collate(column, collate(rows), len(rows), partition)
        if column.kind == RAGGED:
            return pad(rows, column.dtype)
        if column.kind == BINARY:
            return _stack_decoded(column, rows, partition), None
        tensor = torch.from_numpy(np.asarray(rows)).reshape(len(rows), *column.shape)
        if column.dtype != column.stored_dtype:
            tensor = tensor.to(torch_dtype(column.dtype))
        return tensor, None

    def _decoded(self, column: Column, value: bytes, partition: int) -> Any:
        decode = self._decode[column.key]
        assert decode is not None  # the driver refuses a binary column without one
        try:
            return decode(value)
        except Exception as exc:
            raise DataError(
                f"column {column.source!r}, partition {partition}: decode "
                f"{_hook_name(column.decode)} failed on a row ({type(exc).__name__}: {exc}); "
                "fix the function or drop rows it cannot read"
            ) from exc

    def batch(
        self,
        columns: Sequence[Any],
        labels: np.ndarray | None,
        weights: np.ndarray | None,
        partition: int,
    ) -> Batch:
        """A :class:`Batch` from each column's gathered rows (in the layout's order)."""
        inputs: dict[str, torch.Tensor] = {}
        masks: dict[str, torch.Tensor] = {}
        for column, rows in zip(self.layout.columns, columns, strict=True):
            tensor, mask = self.column(column, rows, partition)
            inputs[column.key] = tensor
            if mask is not None:
                masks[column.key] = mask
        return Batch(
            inputs,
            self.layout.call,
            masks,
            None if labels is None else torch.from_numpy(labels),
            None if weights is None else torch.from_numpy(weights.astype(np.float32)),
        )


def pad(rows: Sequence[np.ndarray], dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Variable-length rows padded with zeros to the longest: (values, mask)."""
    lengths = np.fromiter((len(r) for r in rows), np.int64, len(rows))
    longest = max(1, int(lengths.max())) if len(rows) else 1
    mask = np.arange(longest)[None, :] < lengths[:, None]
    values = np.zeros((len(rows), longest), _numpy_dtype(dtype))
    if len(rows):
        values[mask] = np.concatenate(rows) if lengths.sum() else []
    tensor = torch.from_numpy(values)
    if dtype == "bfloat16":
        tensor = tensor.to(torch.bfloat16)
    return tensor, torch.from_numpy(mask)


def _numpy_dtype(dtype: str) -> Any:
    return np.float32 if dtype == "bfloat16" else np.dtype(dtype)


def _stack_decoded(column: Column, rows: list[Any], partition: int) -> torch.Tensor:
    if not rows:
        return torch.zeros(0)
    where = f"column {column.source!r}, partition {partition}: decode {_hook_name(column.decode)}"
    not_arrays = DataError(
        f"{where} returned {type(rows[0]).__name__} values that are not numeric arrays; it "
        "must return a numpy array or a tensor"
    )
    try:
        shapes = {tuple(np.shape(r)) for r in rows}
    except ValueError:  # nested lists of uneven lengths
        raise not_arrays from None
    if len(shapes) > 1:
        raise DataError(
            f"{where} returned rows of different shapes {sorted(shapes)[:3]}; resize them in "
            f"decode, or give a collate for {column.key!r} that batches them"
        )
    if any(isinstance(r, torch.Tensor) for r in rows):
        return torch.stack([torch.as_tensor(r) for r in rows])
    # stacked by numpy into a new array: a decode's read-only view (np.frombuffer of the
    # value) never reaches torch, which warns about those
    stacked = np.stack([np.asarray(r) for r in rows])
    if stacked.dtype.kind not in "biuf":
        raise not_arrays
    return torch.from_numpy(stacked)


def _from_collate(
    column: Column, made: Any, rows: int, partition: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    where = f"column {column.source!r}, partition {partition}: collate {_hook_name(column.collate)}"
    if isinstance(made, torch.Tensor):
        tensor, mask = made, None
    elif (
        isinstance(made, tuple)
        and len(made) == 2
        and isinstance(made[0], torch.Tensor)
        and (made[1] is None or isinstance(made[1], torch.Tensor))
    ):
        tensor, mask = made
    else:
        raise DataError(
            f"{where} returned {type(made).__name__}; it must return a tensor or a "
            "(tensor, mask) pair"
        )
    # the batch's row count (what a step's gradient is weighted by) is its inputs' first
    # dimension: a collate that changes it would skew every step silently
    for what, t in (("tensor", tensor), ("mask", mask)):
        if t is not None and (t.ndim == 0 or t.shape[0] != rows):
            raise DataError(
                f"{where} returned a {what} of shape {tuple(t.shape)} for {rows} rows; its "
                "first dimension must be the batch's rows"
            )
    return tensor, mask


def _hook_name(hook: Hook | None) -> str:
    if isinstance(hook, str):
        return repr(hook)
    return repr(getattr(hook, "__qualname__", hook))


# ---------------------------------------------------------------------- calling the model
_MASK_ARGS: dict[type, tuple[set[str], bool]] = {}


def forward_params(model: nn.Module) -> tuple[set[str], bool]:
    """(parameter names of ``model.forward``, whether it takes ``**kwargs``), cached per
    class."""
    model = getattr(model, "forwards_to", model)  # wrappers passing their arguments on
    cls = type(model)
    found = _MASK_ARGS.get(cls)
    if found is None:
        try:
            params = inspect.signature(model.forward).parameters
        except (TypeError, ValueError):  # builtins without a signature: pass no masks
            found = (set(), False)
        else:
            var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
            found = (set(params), var_kw)
        _MASK_ARGS[cls] = found
    return found


def forward(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Call ``model`` with the batch's inputs as the layout says (see the module
    docstring), passing each mask its model accepts as ``<key>_mask``."""
    extra: dict[str, torch.Tensor] = {}
    if batch.masks:
        names, var_kw = forward_params(model)
        for key, mask in batch.masks.items():
            if var_kw or f"{key}_mask" in names:
                extra[f"{key}_mask"] = mask
    out: torch.Tensor
    if batch.call == "keyword":
        out = model(**batch.inputs, **extra)
    elif batch.call == "positional":
        out = model(*batch.inputs.values(), **extra)
    else:
        out = model(next(iter(batch.inputs.values())), **extra)
    return out


def sample_batch(layout: Layout, samples: dict[str, Any] | None = None, rows: int = 2) -> Batch:
    """A batch of ``rows`` rows to try the model on the driver: zeros for dense and
    ragged columns, the decoded ``samples`` (one raw value per binary column) repeated."""
    collator = Collator(layout)
    columns: list[Any] = []
    for c in layout.columns:
        if c.kind == BINARY:
            value = (samples or {}).get(c.key)
            if value is None:
                raise DataError(f"column {c.source!r} has no non-null value to decode")
            columns.append([value] * rows)
        elif c.kind == RAGGED:
            columns.append([np.zeros(1, _numpy_dtype(c.dtype))] * rows)
        else:
            columns.append(np.zeros((rows, c.width), _numpy_dtype(c.stored_dtype)))
    return collator.batch(columns, None, None, partition=-1)
