"""Which functions a *saved* model or estimator may name.

A saved sparktrain model (or estimator) names functions as ``"package.module:function"``
strings: its factory, the ``modelFn`` param, called as ``modelFn(**modelKwargs)`` to
rebuild the architecture; and per input column a ``decode`` (one binary value to an
array) and a ``collate`` (a column's rows to a batch), held both as params and, in a
model's metadata, in the trained layout (``inputs``) that ``transform`` runs on the
executors. Without a check, a metadata file could name any callable in any importable
module (``builtins:print``, ``os:system``, ``subprocess:run`` with ``modelKwargs`` as its
arguments, or ``os:system`` as a ``decode`` fed a shell command by the row values), and
importing a module alone already runs its code. So loading only accepts names whose
module is allowed, and checks every one of them **before** importing anything:

- the process-wide allowlist: ``sparktrain.models`` (the ready-made factories) plus every
  prefix registered with :func:`allow_model_modules`;
- the Spark conf ``spark.sparktrain.allowedModelModules`` (comma-separated prefixes), read
  on the driver at load time: for jobs that load a ``PipelineModel`` or
  ``CrossValidatorModel`` without code changes;
- an explicit ``model_fn`` passed to ``TorchClassificationModel.load(path, model_fn=...)``
  (the caller's own choice: not checked, as any factory given to ``fit`` is not). There is
  no such override for ``decode`` / ``collate``: allow their module.

A prefix matches whole dotted components: ``"mypkg"`` allows ``mypkg`` and
``mypkg.models.nets``, not ``mypkgevil``. After the allowed module is imported, the named
attribute must be a public callable defined in an allowed module (its ``__module__``),
reached without passing through another module: ``sparktrain.models:nn.Linear`` (a name
the allowed module merely imported) is refused too. ``modelKwargs`` is JSON and only ever
reaches the factory that passed this check.

Only loading is gated. Fitting an estimator built in this process calls the user's own
``modelFn`` and hooks as before, and the executors run the names the driver checked at
load (or the caller set). Executors keep no allowlist of their own.
"""

from __future__ import annotations

import importlib
import threading
import types
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sparktrain.errors import ConfigError

#: Always allowed: the factories that ship with sparktrain.
DEFAULT_ALLOWED_MODULES = ("sparktrain.models",)
#: Spark conf read on the driver when a model is loaded: comma-separated module prefixes.
ALLOWED_MODULES_CONF = "spark.sparktrain.allowedModelModules"

_LOCK = threading.Lock()
_REGISTERED: list[str] = []


def allow_model_modules(*prefixes: str) -> None:
    """Let saved models name factories in these modules (and their submodules).

    ``allow_model_modules("mypkg.models")`` allows ``"mypkg.models:net"`` and
    ``"mypkg.models.cnn:build"``, not ``"mypkg.modelsx:net"``. Process-wide, on the driver
    (where models are loaded); call it before ``load``. Only allow code you trust: a saved
    model's metadata chooses which function of these modules is called, and with which
    (JSON) arguments.
    """
    for prefix in prefixes:
        _check_prefix(prefix, "allow_model_modules")
    with _LOCK:
        for prefix in prefixes:
            if prefix not in _REGISTERED:
                _REGISTERED.append(prefix)


def allowed_model_modules(extra: Iterable[str] = ()) -> tuple[str, ...]:
    """The default prefixes, the registered ones and ``extra``, in that order."""
    with _LOCK:
        registered = tuple(_REGISTERED)
    ordered = dict.fromkeys((*DEFAULT_ALLOWED_MODULES, *registered, *extra))
    return tuple(ordered)


def conf_prefixes(value: str | None) -> tuple[str, ...]:
    """The prefixes in a ``spark.sparktrain.allowedModelModules`` value."""
    prefixes = tuple(p.strip() for p in (value or "").split(",") if p.strip())
    for prefix in prefixes:
        _check_prefix(prefix, ALLOWED_MODULES_CONF)
    return prefixes


def module_allowed(module: str, prefixes: Iterable[str]) -> bool:
    """Is ``module`` one of ``prefixes`` or inside one (whole dotted components)?"""
    return any(module == p or module.startswith(p + ".") for p in prefixes)


@dataclass(frozen=True)
class SavedName:
    """One ``"package.module:function"`` a saved model or estimator names.

    ``field`` says where the metadata holds it (``"modelFn"``, ``"decode['image']"``,
    ``"inputs.collate['tokens']"``), for the error; ``override_hint`` is the call that
    passes the callable explicitly instead, when there is one (``modelFn`` only)."""

    field: str
    name: object
    override_hint: str | None = None


def check_saved_names(
    names: Sequence[SavedName], allowed: Iterable[str], *, source: str
) -> list[Callable[..., Any]]:
    """The callables a saved model names, in order, each imported only if its module is
    allowed.

    Every name is checked against ``allowed`` first, and only when all of them pass is
    any module imported: a hostile ``decode`` is refused before the (allowed) ``modelFn``
    module is imported. Raises :class:`ConfigError` naming ``source`` (what is being
    loaded), the field, the module and how to allow it.
    """
    prefixes = tuple(allowed)
    for saved in names:
        _refuse_unless_allowed(saved, prefixes, source)
    return [_resolve(saved, prefixes, source) for saved in names]


def check_saved_model_fn(
    model_fn: str, allowed: Iterable[str], *, source: str, override_hint: str
) -> Callable[..., Any]:
    """The factory a saved model names, imported only if its module is allowed
    (:func:`check_saved_names` of one ``modelFn``)."""
    saved = SavedName("modelFn", model_fn, override_hint)
    return check_saved_names([saved], allowed, source=source)[0]


def _refuse_unless_allowed(saved: SavedName, prefixes: tuple[str, ...], source: str) -> None:
    """Refuse a malformed name or one outside ``prefixes``; imports nothing."""
    name = saved.name
    module_name, sep, attr = name.partition(":") if isinstance(name, str) else ("", "", "")
    if not sep or not _dotted(module_name) or not _public_attr(attr):
        raise ConfigError(
            f"refusing to load {source}: its {saved.field} {name!r} is not a "
            "'package.module:function' name with a public function"
            + (f"; pass the factory yourself: {saved.override_hint}" if saved.override_hint else "")
        )
    if not module_allowed(module_name, prefixes):
        raise ConfigError(_not_allowed(source, saved, module_name, prefixes))


def _resolve(saved: SavedName, prefixes: tuple[str, ...], source: str) -> Callable[..., Any]:
    """Import an allowed name and check that it is a callable its allowed module
    defines, reached without passing through another module."""
    field, name = saved.field, str(saved.name)
    module_name, _, attr = name.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"{field} {name!r} of {source}: cannot import module {module_name!r} ({exc}); "
            "is it installed on the driver and the executors (or shipped with --py-files)?"
        ) from exc
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ConfigError(
                f"{field} {name!r} of {source}: module {module_name!r} has no attribute {attr!r}"
            )
        target = getattr(target, part)
        if isinstance(target, types.ModuleType):
            raise ConfigError(
                f"refusing to load {source}: {field} {name!r} reaches into module "
                f"{target.__name__!r} through {module_name!r}; name the function by the "
                "module that defines it, and allow that module "
                "(sparktrain.ml.allow_model_modules)"
                + (f", or pass it yourself: {saved.override_hint}" if saved.override_hint else "")
            )
    defined_in = getattr(target, "__module__", None)
    if not isinstance(defined_in, str) or not module_allowed(defined_in, prefixes):
        raise ConfigError(
            _not_allowed(source, saved, str(defined_in), prefixes)
            + f" ({attr!r} is defined in {defined_in!r}, not in {module_name!r})"
        )
    if not callable(target):
        raise ConfigError(f"{field} {name!r} of {source} is not callable")
    return target


def _not_allowed(source: str, saved: SavedName, module: str, prefixes: tuple[str, ...]) -> str:
    override = (
        f", or pass the factory yourself: {saved.override_hint}" if saved.override_hint else ""
    )
    return (
        f"refusing to load {source}: its {saved.field} {saved.name!r} is in module {module!r}, "
        f"which is not allowed in saved models (allowed: {', '.join(prefixes)}). "
        "Loading imports the module a saved model names and calls that function, so it "
        "must be code you trust. If you do, call "
        f"sparktrain.ml.allow_model_modules({module!r}) before loading (or set the Spark "
        f"conf {ALLOWED_MODULES_CONF}={module}){override}"
    )


def _dotted(name: str) -> bool:
    return bool(name) and all(part.isidentifier() for part in name.split("."))


def _public_attr(attr: str) -> bool:
    return _dotted(attr) and not any(part.startswith("_") for part in attr.split("."))


def _check_prefix(prefix: object, where: str) -> None:
    if not isinstance(prefix, str) or not _dotted(prefix):
        raise ConfigError(
            f"{where}: {prefix!r} is not a module name; give dotted module prefixes such as "
            "'mypkg.models' (no ':function', no wildcards)"
        )
