"""Which columns feed the model, as what, and how the model is called.

A fit names its inputs in one of three ways (``features_col`` of :meth:`Trainer.fit`,
``featuresCols`` of the ml estimators):

- one column name, ``"features"``: the model is called ``model(x)``;
- a list of names, ``["ids", "dense"]``: ``model(ids, dense)``, in that order;
- a mapping ``{"user": "user_id", "item": "item_id"}`` of model arguments to columns:
  ``model(user=..., item=...)``.

Each column becomes one :class:`Column`: its *kind* says how rows become a tensor.

``dense``
    numbers of one fixed shape per row: a numeric scalar, an ml Vector, or a numeric array
    whose rows all have the same length. ``feature_shapes`` may give the row a shape
    (``{"image": [1, 28, 28]}``: 784 values per row arrive as ``(batch, 1, 28, 28)``).
``ragged``
    a numeric array whose rows differ in length, declared with a ``-1`` shape
    (``feature_shapes = {"tokens": [-1]}``): each batch is padded with zeros to its
    longest row and comes with a boolean mask (``True`` at real values); a ``collate``
    for the column replaces the padding.
``binary``
    bytes (encoded images, serialised records), turned into arrays per row by the
    column's ``decode`` (``"module:function"`` or a callable) in the data loader.

Dtypes: integer columns and integer arrays stay ``int64`` (ids, tokens, category codes are
never round-tripped through a float); floating columns arrive as ``float32``, torch's
default dtype, so that a ``double`` column still feeds a float32 model, unless
``feature_dtypes`` names another dtype for them (``{"x": "float64"}``).

Labels: ``label_col`` is one numeric column (a ``(batch,)`` target), one numeric array
column of fixed length ``k`` (a ``(batch, k)`` target: multi-label, multi-output), or a
list of numeric columns (stacked to ``(batch, k)``).

Nothing here imports pyspark: the layout travels to the executors inside the job spec.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from sparktrain.errors import ConfigError, DataError

Kind = Literal["dense", "ragged", "binary"]
DENSE: Final = "dense"
RAGGED: Final = "ragged"
BINARY: Final = "binary"
Call = Literal["single", "positional", "keyword"]

FLOAT_DTYPES = ("float32", "float64", "float16", "bfloat16")
INT_DTYPE = "int64"
DEFAULT_FLOAT = "float32"
# bfloat16 has no numpy dtype: its rows are kept as float32 and cast when batched
STORED_AS = {"bfloat16": "float32"}

ColumnsSpec = str | Sequence[str] | Mapping[str, str]
"""What ``features_col`` accepts: a name, a list of names, or ``{model_argument: name}``."""
Hook = str | Callable[..., Any]
"""A ``decode`` or ``collate``: ``"module:function"`` or, from Python, a callable."""


@dataclass(frozen=True)
class Column:
    """One model input: the DataFrame column ``source``, shipped to the workers as
    ``wire``, delivered in the batch under ``key`` with ``dtype`` and row ``shape``."""

    key: str
    source: str
    wire: str
    kind: Kind
    dtype: str
    shape: tuple[int, ...] = ()
    decode: Hook | None = field(default=None, compare=False)
    collate: Hook | None = field(default=None, compare=False)

    @property
    def width(self) -> int:
        """Values per row of a dense column (1 for a scalar)."""
        return math.prod(self.shape) if self.shape else 1

    @property
    def stored_dtype(self) -> str:
        """The numpy dtype rows are held in on the worker."""
        return STORED_AS.get(self.dtype, self.dtype)

    def describe(self) -> str:
        shape = "x".join(str(d) for d in self.shape) or "scalar"
        if self.kind == RAGGED:
            shape = "variable length"
        elif self.kind == BINARY:
            shape = "bytes, decoded"
        name = self.source if self.key == self.source else f"{self.key}={self.source}"
        return f"{name} ({self.kind}, {self.dtype}, {shape})"


@dataclass(frozen=True)
class Layout:
    """Every model input column, how the model is called, and the labels' shape.

    ``label_width`` is ``None`` for a scalar label (targets of shape ``(batch,)``) and
    ``k`` for ``k`` labels per row (``(batch, k)``)."""

    columns: tuple[Column, ...]
    call: Call = "single"
    label_width: int | None = None
    label_sources: tuple[str, ...] = ("label",)

    @property
    def keys(self) -> list[str]:
        return [c.key for c in self.columns]

    @property
    def is_plain(self) -> bool:
        """One float32 vector column called ``model(x)`` and a scalar label: the layout
        every strategy and pipelines take (tree_aggregate and pipelines take only this)."""
        if self.call != "single" or len(self.columns) != 1 or self.label_width is not None:
            return False
        col = self.columns[0]
        return col.kind == DENSE and col.dtype == DEFAULT_FLOAT and len(col.shape) == 1

    @property
    def width(self) -> int:
        """The plain layout's feature width (see :attr:`is_plain`)."""
        return self.columns[0].width

    def describe(self) -> str:
        inputs = ", ".join(c.describe() for c in self.columns)
        label = "scalar" if self.label_width is None else f"{self.label_width} per row"
        return f"model inputs [{inputs}] called {self.call}; labels {label}"

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (the run summary's ``inputs``, a saved ml model's
        metadata); a hook given as a callable is shown by name and cannot be read back."""
        return {
            "call": self.call,
            "columns": [
                {
                    "key": c.key,
                    "source": c.source,
                    "wire": c.wire,
                    "kind": c.kind,
                    "dtype": c.dtype,
                    "shape": list(c.shape),
                    "decode": _hook_text(c.decode),
                    "collate": _hook_text(c.collate),
                }
                for c in self.columns
            ],
            "label_width": self.label_width,
            "label_sources": list(self.label_sources),
        }

    @staticmethod
    def from_dict(values: Mapping[str, Any]) -> Layout:
        """The inverse of :meth:`to_dict`."""
        columns = tuple(
            Column(
                c["key"],
                c["source"],
                c["wire"],
                c["kind"],
                c["dtype"],
                tuple(c["shape"]),
                c.get("decode"),
                c.get("collate"),
            )
            for c in values["columns"]
        )
        return Layout(
            columns, values["call"], values.get("label_width"), tuple(values["label_sources"])
        )

    @staticmethod
    def plain(width: int) -> Layout:
        """One float32 column ``features`` of ``width`` values, a scalar label."""
        return Layout((Column("features", "features", "features", DENSE, DEFAULT_FLOAT, (width,)),))


def _hook_text(hook: Hook | None) -> str | None:
    if hook is None or isinstance(hook, str):
        return hook
    return f"{getattr(hook, '__module__', '?')}:{getattr(hook, '__qualname__', repr(hook))}"


def parse_columns(spec: Any, what: str = "features_col") -> tuple[Call, list[tuple[str, str]]]:
    """``features_col`` as (how the model is called, [(key, source column)])."""
    if isinstance(spec, str):
        if not spec:
            raise ConfigError(f"{what} is empty: name the column(s) that feed the model")
        return "single", [(spec, spec)]
    if isinstance(spec, Mapping):
        if not spec:
            raise ConfigError(f"{what} is an empty mapping: give {{model_argument: column}}")
        pairs = []
        for key, source in spec.items():
            if not isinstance(key, str) or not key.isidentifier():
                raise ConfigError(
                    f"{what}: {key!r} is not a Python identifier, so it cannot be a keyword "
                    "argument of the model's forward(); use the argument's name as the key"
                )
            if not isinstance(source, str) or not source:
                raise ConfigError(f"{what}: {key!r} maps to {source!r}; give a column name")
            pairs.append((key, source))
        return "keyword", pairs
    if isinstance(spec, Sequence) and not isinstance(spec, bytes):
        names = list(spec)
        if not names or not all(isinstance(n, str) and n for n in names):
            raise ConfigError(f"{what} as a list needs one or more column names, got {spec!r}")
        if len(set(names)) != len(names):
            raise ConfigError(f"{what} names a column twice: {names}")
        return "positional", [(n, n) for n in names]
    raise ConfigError(
        f"{what} must be a column name, a list of names or a {{model_argument: column}} "
        f"mapping, got {type(spec).__name__}"
    )


def parse_labels(spec: Any) -> list[str]:
    """``label_col`` as a list of column names (one name: one label column)."""
    if isinstance(spec, str) and spec:
        return [spec]
    if (
        isinstance(spec, Sequence)
        and not isinstance(spec, str | bytes)
        and spec
        and all(isinstance(n, str) and n for n in spec)
    ):
        if len(set(spec)) != len(spec):
            raise ConfigError(f"label_col names a column twice: {list(spec)}")
        return list(spec)
    raise ConfigError(f"label_col must be a column name or a list of names, got {spec!r}")


def check_options(
    keys: Sequence[str],
    sources: Sequence[str],
    feature_shapes: Mapping[str, Any],
    feature_dtypes: Mapping[str, Any],
    decode: Mapping[str, Any],
    collate: Mapping[str, Any],
) -> None:
    """Every per-column option names an input column (by model argument or column name)
    and holds a value it can use."""
    known = set(keys) | set(sources)
    for option, table in (
        ("feature_shapes", feature_shapes),
        ("feature_dtypes", feature_dtypes),
        ("decode", decode),
        ("collate", collate),
    ):
        for name in table:
            if name not in known:
                raise ConfigError(
                    f"{option} names {name!r}, which is not a model input; the inputs are "
                    f"{sorted(known)} (name a column or its model argument)"
                )


def option_for(table: Mapping[str, Any], key: str, source: str, keys: Sequence[str] = ()) -> Any:
    """A per-column option given under the model argument or the column name. A name that
    is another input's model argument (``keys``) belongs to that argument alone."""
    if key in table:
        return table[key]
    if source in keys:
        return None
    return table.get(source)


def check_shape(name: str, shape: Any) -> tuple[int, ...]:
    """A ``feature_shapes`` entry: positive sizes, or ``[-1]`` for variable length."""
    if not isinstance(shape, Sequence) or isinstance(shape, str) or not shape:
        raise ConfigError(
            f"feature_shapes[{name!r}] = {shape!r}: give the row's shape as a list of sizes, "
            "e.g. [1, 28, 28], or [-1] for a variable-length array"
        )
    dims = []
    for d in shape:
        if not isinstance(d, int) or isinstance(d, bool) or not (d > 0 or d == -1):
            raise ConfigError(
                f"feature_shapes[{name!r}] = {list(shape)!r}: sizes must be positive integers "
                "(or [-1] alone for a variable-length array)"
            )
        dims.append(d)
    if -1 in dims and dims != [-1]:
        raise ConfigError(
            f"feature_shapes[{name!r}] = {dims!r}: only one-dimensional variable-length arrays "
            "are padded ([-1]); use a collate for other shapes"
        )
    return tuple(dims)


def check_dtype(name: str, dtype: Any) -> str:
    """A ``feature_dtypes`` entry: one of the float dtypes or int64."""
    allowed = (*FLOAT_DTYPES, INT_DTYPE)
    if dtype not in allowed:
        raise ConfigError(
            f"feature_dtypes[{name!r}] = {dtype!r} is not supported; allowed: {', '.join(allowed)}"
        )
    return str(dtype)


def row_shape_error(column: Column, found: int, partition: int) -> DataError:
    """A dense column whose row holds the wrong number of values."""
    if column.shape and len(column.shape) > 1:
        hint = (
            f"its feature_shapes entry {list(column.shape)} needs {column.width} values a row; "
            "fix the shape or the data"
        )
    else:
        hint = (
            f"declare it variable-length with feature_shapes={{{column.key!r}: [-1]}} (padded "
            "per batch, with a mask) or make every row the same length"
        )
    return DataError(
        f"column {column.source!r}, partition {partition}: a row has {found} values, the first "
        f"row had {column.width}; {hint}"
    )
