"""pyspark's ``TorchDistributor`` as the benchmarks run it: local mode, CPU, loopback,
and rank 0's record as the result.

Shared by ``bench train`` (digits, DDP against the ring) and ``bench sparse`` (the
two-tower recommender, DDP with dense and with sparse embeddings).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from sparktrain.errors import SparkTrainError


def run_local(fn: Callable[..., Any], *args: Any, workers: int) -> Any:
    """``TorchDistributor(num_processes=workers, local_mode=True, use_gpu=False).run(fn,
    *args)`` over loopback (as sparktrain's own sockets); ``fn`` returns rank 0's record
    on every rank (:func:`rank0_everywhere`). A ``None`` result is refused."""
    from pyspark.ml.torch.distributor import TorchDistributor

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback, like ours
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    result = TorchDistributor(num_processes=workers, local_mode=True, use_gpu=False).run(fn, *args)
    if result is None:
        raise SparkTrainError("TorchDistributor returned nothing from rank 0")
    return result


def run_cluster(fn: Callable[..., Any], *args: Any, workers: int) -> Any:
    """``TorchDistributor(num_processes=workers, local_mode=False, use_gpu=False).run(fn,
    *args)``: torchrun inside the tasks of a barrier stage; rank 0's return value."""
    from pyspark.ml.torch.distributor import TorchDistributor

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    result = TorchDistributor(num_processes=workers, local_mode=False, use_gpu=False).run(fn, *args)
    if result is None:
        raise SparkTrainError("TorchDistributor returned nothing from rank 0")
    return result


def rank0_everywhere(record: Any) -> Any:
    """Inside a TorchDistributor process: rank 0's ``record`` on every rank, then the
    process group destroyed. Local mode has every process pickle its return value to the
    same file, last writer wins, so every rank must return rank 0's."""
    import torch.distributed as dist

    shared: list[Any] = [record if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    dist.destroy_process_group()
    return shared[0]
