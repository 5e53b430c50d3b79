"""How a job's spec is pickled for its tasks, so that functions defined in a script or a
notebook (``__main__``) travel as users write them.

Spark pickles a task's closure with cloudpickle, which pickles a function of an
importable module by reference and a function of ``__main__`` by value: its code, the
globals its code names and the already-imported submodules of those globals that its
attribute names could reach (with ``torch`` a global, ``ctx.distributed`` and
``ctx.config`` reach ``torch.distributed.config``). cloudpickle pickles a module by
reference only when its type is ``ModuleType`` itself; torch's config modules
(``torch.distributed.config``, ``torch._dynamo.config``, ...) and ``torch.backends.*``
are instances of ``ModuleType`` subclasses, which fall through to the default reduce and
fail (``TypeError: cannot pickle 'ConfigModuleInstance' object``, cloudpipe/cloudpickle
issue 405). A ``train_fn`` written in a script with ``import torch`` hit exactly that.

:func:`dumps` is Spark's cloudpickle with that one case fixed: an importable module of
any type goes by reference, as a plain module does. :func:`shippable` gives a spec (a
dataclass such as :class:`~sparktrain.task.context.JobSpec`) that Spark's pickler
pickles through :func:`dumps`; it is tried once on the driver before any task starts,
so a part that cannot be pickled is a :class:`~sparktrain.errors.ConfigError` that names
it. In the task the spec unpickles as the plain dataclass, so nothing on the executors
changes; the bytes are the closure's own, from the driver, as Spark's are.
"""

from __future__ import annotations

import dataclasses
import importlib
import io
import pickle
import sys
from collections.abc import Mapping
from types import ModuleType
from typing import Any, TypeVar

from pyspark import cloudpickle

from sparktrain.errors import ConfigError

T = TypeVar("T")

PICKLE_HELP = (
    "Spark sends it to every task by pickling it: a function or class defined in a script "
    "or a notebook goes by value, with the globals it names, and a SparkSession, a "
    "DataFrame, a socket, a lock or an open file cannot go. Create or import such objects "
    "inside the function, or pass an importable 'package.module:function'"
)


class _Pickler(cloudpickle.Pickler):
    """cloudpickle, with importable modules of ``ModuleType`` subclasses by reference."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, ModuleType) and type(obj) is not ModuleType:
            name = obj.__name__
            if sys.modules.get(name) is obj:  # what importing the name gives back
                return importlib.import_module, (name,)
        return super().reducer_override(obj)


def dumps(obj: Any) -> bytes:
    """``obj`` pickled as Spark pickles a closure (cloudpickle), except that every
    importable module goes by reference, whatever its type; loads with :func:`pickle.loads`
    where pyspark is installed."""
    buf = io.BytesIO()
    _Pickler(buf, protocol=cloudpickle.DEFAULT_PROTOCOL).dump(obj)
    return buf.getvalue()


class _Shipped:
    """Mixin of a spec that pickles through :func:`dumps` and unpickles as the plain spec
    (its base class)."""

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        # pickled now, inside Spark's own pickling of the closure: a broadcast variable in
        # the spec registers itself with the SparkContext at this moment, so that Spark
        # ships it with this job (bytes pickled earlier would leave it behind)
        return pickle.loads, (dumps(_plain(self)),)


_SHIPPED: dict[type, type] = {}


def shippable(spec: T) -> T:
    """``spec`` (a dataclass instance), as an object that behaves as it does on the driver
    and that Spark's pickler pickles through :func:`dumps`; it is pickled once here too,
    so a part that cannot be pickled fails on the driver with a
    :class:`~sparktrain.errors.ConfigError` naming it (e.g. ``train_fn``,
    ``config.decode['image']``) before any task starts."""
    base = type(spec)
    try:
        dumps(spec)  # fail here, by the part's name, not in the tasks
    except Exception as exc:
        raise _unpicklable(spec, exc) from exc
    cls = _SHIPPED.get(base)
    if cls is None:
        cls = _SHIPPED[base] = type(base.__name__, (_Shipped, base), {})
        cls.__qualname__ = f"shippable({base.__qualname__})"
    shipped: Any = object.__new__(cls)
    vars(shipped).update(vars(spec))
    return shipped


def _plain(spec: Any) -> Any:
    """The base-class instance a shipped spec stands for."""
    base = next(
        c for c in type(spec).__mro__[1:] if c is not _Shipped and dataclasses.is_dataclass(c)
    )
    plain = object.__new__(base)
    vars(plain).update(vars(spec))
    return plain


def _unpicklable(spec: Any, exc: Exception) -> ConfigError:
    """The error for a spec that does not pickle (``exc``): the innermost part that
    fails, by its path (a field, a config key, a mapping's key or a list's index)."""
    path, exc = _failing_part(spec, "", exc, 0)
    what = path or type(spec).__name__
    return ConfigError(
        f"{what} cannot be pickled for the executors ({type(exc).__name__}: {exc}). {PICKLE_HELP}"
    )


def _failing_part(obj: Any, path: str, exc: Exception, depth: int) -> tuple[str, Exception]:
    """The path below ``obj`` (which failed with ``exc``) of the innermost part that does
    not pickle on its own, with its error; ``obj`` itself when no part fails alone."""
    parts: list[tuple[str, Any]] = []
    if depth < 4:
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            sep = "." if path else ""
            parts = [
                (f"{path}{sep}{f.name}", getattr(obj, f.name)) for f in dataclasses.fields(obj)
            ]
        elif isinstance(obj, Mapping):
            parts = [(f"{path}[{k!r}]", v) for k, v in obj.items()]
        elif isinstance(obj, list | tuple):
            parts = [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
    for sub_path, value in parts:
        try:
            dumps(value)
        except Exception as sub_exc:
            return _failing_part(value, sub_path, sub_exc, depth + 1)
    return path, exc
