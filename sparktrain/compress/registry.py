"""Compressor names -> factories, and :func:`build`: a spec string to a
:class:`~sparktrain.compress.base.Compressor`.

This module sits above the compressors: it imports every built-in one and registers it;
they import only :mod:`~sparktrain.compress.base` and :mod:`~sparktrain.compress.spec`.
A compressor of your own is one factory and a :func:`register` call::

    register("mine", lambda stage: Mine(ratio=float_option(stage, "ratio", 0.1, 0.0, 1.0)))

after which ``compression="mine:0.05+ef"`` builds it. Registered on the driver, it
reaches the executors with the job: :func:`plugins` (what the driver holds beyond the
built-ins) rides in the job's spec, pickled as Spark pickles a task (a factory of an
importable module by reference, one of a script or notebook by value), and the task
hands it to :func:`install` before it builds any compressor. The grammar is in
:mod:`sparktrain.compress.spec`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sparktrain.compress import cast, int8, powersgd, sign, topk
from sparktrain.compress.base import Compressor
from sparktrain.compress.cast import Identity
from sparktrain.compress.delta import Delta
from sparktrain.compress.feedback import ErrorFeedback
from sparktrain.compress.spec import (
    EF_OPTIONS,
    WRAPPERS,
    Stage,
    check_options,
    fail,
    float_option,
    int_option,
    parse,
)

Factory = Callable[[Stage], Any]
_REGISTRY: dict[str, Factory] = {}


def register(name: str, factory: Factory) -> None:
    """Make ``name`` usable in specs; ``factory(stage)`` builds the compressor."""
    _REGISTRY[name] = factory


def registered() -> list[str]:
    """The names specs may use for the core compressor."""
    return sorted(_REGISTRY)


for _module in (cast, int8, topk, sign, powersgd):
    _module.register_all(register)
_BUILTIN: dict[str, Factory] = dict(_REGISTRY)
"""The built-in compressors' factories, as their modules registered them."""


def plugins() -> dict[str, Factory]:
    """The compressors registered beyond the built-ins, by name: a name of its own, or a
    built-in name registered again (its new factory). A job carries them to its tasks
    (:func:`install`), so the executors build what the driver builds."""
    return {name: f for name, f in _REGISTRY.items() if _BUILTIN.get(name) is not f}


def install(factories: Mapping[str, Factory]) -> None:
    """In a task, before any compressor is built: register a job's :func:`plugins`. A
    built-in name the job does not register again gets its built-in factory back (a
    reused Python worker may still hold an earlier job's); names of earlier jobs' own
    stay, unused: the driver checks every spec against its registry."""
    for name, factory in _BUILTIN.items():
        if _REGISTRY.get(name) is not factory and name not in factories:
            _REGISTRY[name] = factory
    for name, factory in factories.items():
        if _REGISTRY.get(name) is not factory:
            _REGISTRY[name] = factory


def parse_spec(spec: str) -> list[Stage]:
    """Split and check a spec; raises ConfigError naming the registered compressors and
    the allowed forms."""
    return parse(spec, _REGISTRY)


def build(spec: str) -> Compressor | None:
    """The compressor for ``spec`` (None for ``"none"``); ConfigError if invalid."""
    stages = parse_spec(spec)
    if not stages:
        return None
    for s in stages:
        if s.name == "ef":
            check_options(s, 0, EF_OPTIONS, ())
        elif s.name == "delta":
            check_options(s, 0, (), ())
    core = [s for s in stages if s.name not in WRAPPERS]
    comp: Compressor = _REGISTRY[core[0].name](core[0]) if core else Identity()
    if stages[0].name == "delta":
        comp = Delta(comp)
    if stages[-1].name == "ef":
        ef = stages[-1]
        momentum = float_option(ef, "momentum", 0.0, -1e-12, 1.0) if ef.option("momentum") else 0.0
        if momentum >= 1.0:
            raise fail(ef, f"momentum={momentum:g} must be in [0, 1)")
        mask = int_option(ef, "mask", -1, low=0)
        if mask > 1:
            raise fail(ef, f"mask={mask} must be 0 (off) or 1 (on)")
        nesterov = int_option(ef, "nesterov", 0, low=0)
        if nesterov > 1:
            raise fail(ef, f"nesterov={nesterov} must be 0 (off) or 1 (on)")
        local_clip = float_option(ef, "local_clip", 0.0, 0.0, math.inf)
        if not math.isfinite(local_clip):
            raise fail(ef, f"local_clip={local_clip} must be a finite number > 0")
        comp = ErrorFeedback(
            comp,
            reset=int_option(ef, "reset", 0, low=0),
            momentum=momentum,
            mask=None if mask < 0 else bool(mask),
            local_clip=local_clip,
            nesterov=bool(nesterov),
        )
    return comp


def validate_spec(spec: str) -> None:
    """Raise ConfigError unless ``spec`` builds."""
    build(spec)


@dataclass(frozen=True)
class SpecParts:
    """A spec cut into its three roles (see :func:`split_spec`)."""

    delta: bool
    """``delta+`` in front: repeated sends (parameter-server pulls) are delta-compressed."""
    base: str
    """The core compressor without wrappers (``"none"`` if there is none)."""
    gradient: str
    """The spec for fresh gradients: the core plus ``+ef...`` (no ``delta+``)."""


def split_spec(spec: str) -> SpecParts:
    """Cut a valid spec into ``delta+`` / core / ``+ef`` (ConfigError if invalid)."""
    parse_spec(spec)
    text = "".join(spec.split())
    if text.lower() == "none":
        return SpecParts(False, "none", "none")
    items = text.split("+")
    delta = items[0].partition(":")[0].lower() == "delta"
    if delta:
        items = items[1:]
    ef = bool(items) and items[-1].partition(":")[0].lower() == "ef"
    core = items[:-1] if ef else items
    base = core[0] if core else "none"
    return SpecParts(delta, base, "+".join(items) if core else "none")
