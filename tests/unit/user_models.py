"""A user's model module for the model-loading tests: not under ``sparktrain.models``, so a
saved model naming it loads only once it is allowed.

A module of its own, not part of :mod:`tests.unit.fixtures`: saved models name it by path
(``tests.unit.user_models:tiny``) and the allowlist tests allow exactly this module, so it
must hold nothing but user models."""

from collections import OrderedDict  # re-exported name: not defined here, so never allowed

from torch import nn

__all__ = ["OrderedDict", "tiny"]


def tiny(in_features: int = 4, out_features: int = 3) -> nn.Module:
    """A single linear layer."""
    return nn.Linear(in_features, out_features)
