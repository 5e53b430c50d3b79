"""Gradient-aggregation strategies as registered plug-ins.

A strategy is one :class:`~sparktrain.strategies.base.Strategy` subclass with a driver
half (validation, how it launches, driver-side services, where a restart resumes) and a
worker half (the step sync each rank runs). Adding one is one module and one
:func:`register` call; ``TrainConfig(strategy=name)`` then finds it. See
docs/architecture.md.
"""

from sparktrain.strategies.registry import get, names, register

__all__ = ["get", "names", "register"]
