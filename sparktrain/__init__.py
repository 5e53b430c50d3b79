"""sparktrain: distributed PyTorch training on Apache Spark.

The public API is these names (``run`` takes your own training loop, ``torch_run`` a
function written for pyspark's TorchDistributor); everything
else is reached through them, the ``sparktrain`` command line, or ``jobs/*.py`` for
spark-submit.

They are imported on first use (PEP 562), not with the package: ``import
sparktrain.session`` then costs no torch import, so :func:`sparktrain.session.get_or_create_session`
can import torch while the JVM starts instead of before it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from sparktrain import _moved
from sparktrain import torchcheck as _torchcheck

if TYPE_CHECKING:
    from sparktrain.config import TrainConfig
    from sparktrain.distributor import torch_run
    from sparktrain.driver.services.loggers import Callback
    from sparktrain.errors import DefaultsChangedWarning
    from sparktrain.result import TrainResult
    from sparktrain.runner import RunResult, run
    from sparktrain.torch_distributor import TorchDistributor
    from sparktrain.trainer import Trainer

__all__ = [
    "Callback",
    "DefaultsChangedWarning",
    "RunResult",
    "TorchDistributor",
    "TrainConfig",
    "TrainResult",
    "Trainer",
    "run",
    "torch_run",
]
__version__ = "0.2.0"

# Old module paths (sparktrain/_moved.py) import their new modules, with a warning, for one
# more release.
_moved.install()

# A torch whose torch.load(weights_only=True) has known bypasses is refused at once, here
# on the driver and in every Python worker (which imports sparktrain to run a task).
_torchcheck.check_torch()

_HOMES = {"TrainConfig": "sparktrain.config", "Trainer": "sparktrain.trainer"}
_HOMES["TrainResult"] = "sparktrain.result"
_HOMES["run"] = _HOMES["RunResult"] = "sparktrain.runner"
# not sparktrain/torch_run.py: importing a submodule of that name would replace this
# function by the module on the package
_HOMES["torch_run"] = "sparktrain.distributor"
_HOMES["TorchDistributor"] = "sparktrain.torch_distributor"
_HOMES["Callback"] = "sparktrain.driver.services.loggers"
_HOMES["DefaultsChangedWarning"] = "sparktrain.errors"


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        value = getattr(importlib.import_module(_HOMES[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'sparktrain' has no attribute {name!r}")
