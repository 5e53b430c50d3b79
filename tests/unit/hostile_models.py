"""Stands for a module an attacker names in a saved model's metadata. Importing a module
runs its code, so the model-loading tests assert that this module is never imported
(``"tests.unit.hostile_models" not in sys.modules``). Nothing may import it, so it
cannot live in :mod:`tests.unit.fixtures`."""

from torch import nn

IMPORTED = True  # module code ran


def net() -> nn.Module:
    """A valid factory: on a loader without the allowlist, loading would succeed."""
    return nn.Linear(4, 3)
