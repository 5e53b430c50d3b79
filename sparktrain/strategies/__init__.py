"""Gradient-aggregation strategies as registered plug-ins.

A strategy is one :class:`~sparktrain.strategies.base.Strategy` subclass with a driver
half (validation, how it launches, driver-side services, where a restart resumes) and a
worker half (the step sync each rank runs). Adding one is one module and one
:func:`register` call; ``TrainConfig(strategy=name)`` then finds it. See
docs/architecture.md.
"""

# The built-in strategies register themselves as they are imported, and they are imported
# here, by the package, whenever any of its modules is: the registry below them imports
# no plug-in, so no import of it can loop back through a strategy.
from sparktrain.strategies import allreduce, ps, tree_aggregate
from sparktrain.strategies.registry import get, names, register

__all__ = ["allreduce", "get", "names", "ps", "register", "tree_aggregate"]
