"""sparktrain: distributed PyTorch training on Apache Spark.

The public API is these three names; everything else is reached through them, the
``sparktrain`` command line, or ``jobs/*.py`` for spark-submit.
"""

from sparktrain.config import TrainConfig
from sparktrain.trainer import Trainer, TrainResult

__all__ = ["TrainConfig", "TrainResult", "Trainer"]
__version__ = "0.1.0"
