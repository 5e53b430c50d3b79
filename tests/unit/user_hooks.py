"""A user's hook module for the model-loading tests (``mypkg`` in the issue): a
``decode`` a model is trained with, outside ``sparktrain``, so a saved model naming it
loads only once it is allowed. A module of its own, so that allowing it allows nothing
else."""

import numpy as np


def f32(value: bytes) -> np.ndarray:
    """One binary value holding float32 numbers, as an array."""
    return np.frombuffer(value, dtype=np.float32)
