"""Compressor names -> factories, and :func:`build`: a spec string to a
:class:`~sparktrain.compress.base.Compressor`.

This module sits above the compressors: it imports every built-in one and registers it;
they import only :mod:`~sparktrain.compress.base` and :mod:`~sparktrain.compress.spec`.
A compressor of your own is one factory and a :func:`register` call::

    register("mine", lambda stage: Mine(ratio=float_option(stage, "ratio", 0.1, 0.0, 1.0)))

after which ``compression="mine:0.05+ef"`` builds it (on every process that builds
compressors: the driver and the executors). The grammar is in
:mod:`sparktrain.compress.spec`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
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
        local_clip = float_option(ef, "local_clip", 0.0, 0.0, math.inf)
        if not math.isfinite(local_clip):
            raise fail(ef, f"local_clip={local_clip} must be a finite number > 0")
        comp = ErrorFeedback(
            comp,
            reset=int_option(ef, "reset", 0, low=0),
            momentum=momentum,
            mask=None if mask < 0 else bool(mask),
            local_clip=local_clip,
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
