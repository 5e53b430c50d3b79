"""Stands for a module an attacker names in a saved model's metadata. Importing a module
runs its code, so the model-loading tests assert that this module is never imported
(``"tests.unit.hostile_models" not in sys.modules``). Nothing may import it, so it
cannot live in :mod:`tests.unit.fixtures`."""

import torch
from torch import nn

IMPORTED = True  # module code ran


def net() -> nn.Module:
    """A valid factory: on a loader without the allowlist, loading would succeed."""
    return nn.Linear(4, 3)


def touch(value: bytes) -> torch.Tensor:
    """A ``decode`` an attacker could name: creates the file the row's value names (the
    stand-in for any command it could run), then returns a valid 4-value row, so that a
    ``transform`` through it would succeed."""
    with open(value.decode(), "w"):
        pass
    return torch.zeros(4)
