"""The strategy registry: names to :class:`~sparktrain.strategies.base.Strategy` objects.

It sits at the bottom of the house (it imports only the errors and no plug-in): the
config checks a strategy's name here, and executors find a strategy's worker half here.
Every strategy registers itself when its module is imported: the built-in ones with their
package, :mod:`sparktrain.strategies`, which Python imports before this module; a
plug-in with its own module (for executors: ship that module with
``SparkContext.addPyFile`` or install it, since a job's strategy object is unpickled
there by reference to its module).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from sparktrain.errors import ConfigError, did_you_mean

if TYPE_CHECKING:
    from sparktrain.strategies.base import Strategy

_REGISTERED: dict[str, Strategy] = {}
_LOCK = threading.Lock()


def register(strategy: Strategy) -> Strategy:
    """Make ``strategy`` available as ``TrainConfig(strategy=strategy.name)``.

    Registering the same class again (a module imported twice, a reused Python worker)
    is a no-op; another class under a taken name is refused.
    """
    name = getattr(strategy, "name", None)
    if not isinstance(name, str) or not name.isidentifier():
        raise ConfigError(
            f"a strategy needs a `name` that is an identifier (e.g. 'allgather_mean'), "
            f"got {name!r} on {type(strategy).__name__}"
        )
    with _LOCK:
        known = _REGISTERED.get(name)
        if known is not None and type(known).__qualname__ != type(strategy).__qualname__:
            raise ConfigError(
                f"strategy {name!r} is already registered by {type(known).__module__}."
                f"{type(known).__qualname__}: give yours another name"
            )
        _REGISTERED[name] = strategy
    return strategy


def get(name: str) -> Strategy:
    """The strategy registered as ``name`` (case ignored, as compressor names are); the
    error lists every name there is and the closest one."""
    name = canonical(name)
    found = _REGISTERED.get(name)
    if found is None:
        raise ConfigError(
            f"strategy={name!r} is not registered; registered strategies: "
            f"{', '.join(names())}.{did_you_mean(name, names())} For a plug-in: did you "
            "forget to import the "
            "module that calls sparktrain.strategies.register() (and ship it to the "
            "executors with SparkContext.addPyFile)?"
        )
    return found


def check_known(name: str) -> None:
    """Raise the ConfigError :func:`get` would for a name that is neither built in nor
    registered, without importing any strategy."""
    if not is_known(canonical(name)):
        get(name)


def canonical(name: str) -> str:
    """``name`` as registered: ``"Ring"`` is ``"ring"``. A name that matches none, or
    several that differ only in case, is returned as given."""
    if not isinstance(name, str) or name in _REGISTERED:
        return name
    folded = [n for n in names() if n.lower() == name.lower()]
    return folded[0] if len(folded) == 1 else name


def names() -> list[str]:
    """Every strategy name there is: the built-ins, then plug-ins in registration order."""
    return list(_REGISTERED)


def having(ability: str) -> list[str]:
    """The names of the strategies whose class says yes to ``ability`` (an attribute of
    :class:`~sparktrain.strategies.base.Strategy`, e.g. ``"supports_run"``), built-ins
    first: what an error lists as the strategies that can."""
    return [n for n in names() if getattr(get(n), ability)]


def spelled(choices: list[str]) -> str:
    """``'ring', 'tree' or 'ps'``: ``choices`` as an error message lists them."""
    quoted = [repr(c) for c in choices]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


def is_known(name: object) -> bool:
    """Is ``name`` a built-in or registered strategy?"""
    return isinstance(name, str) and name in _REGISTERED
