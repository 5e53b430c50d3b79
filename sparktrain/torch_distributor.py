"""``sparktrain.TorchDistributor``: pyspark's ``TorchDistributor`` with the import changed.

>>> from sparktrain import TorchDistributor  # was: from pyspark.ml.torch.distributor import ...
>>> TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(
...     train, 1e-3, batch_size=64)  # doctest: +SKIP
>>> TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).run(
...     "train.py", "--lr", "0.1")  # doctest: +SKIP

The constructor takes the same arguments and raises the same errors as pyspark's
(``num_processes`` positive; with ``use_gpu=True``, GPUs configured on the driver or
``spark.task.resource.gpu.amount`` set). ``run(train_object, *args, **kwargs)`` calls
a function with ``args`` and ``kwargs`` (every keyword goes to the function) or runs a
Python file with ``args`` as its command line (no keywords), with ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT`` set as torchrun sets them.

- ``local_mode=False``: on ``num_processes`` barrier tasks, through
  :func:`sparktrain.distributor.launch` (the stage runner of :func:`sparktrain.torch_run`:
  authenticated rendezvous, restarts). ``use_gpu=False`` sets ``CUDA_VISIBLE_DEVICES=""``
  in the tasks, as pyspark does.
- ``local_mode=True``: ``num_processes`` Python processes on the driver's host, no Spark
  task. The function, its arguments and rank 0's return value travel by pickle through
  files in a fresh directory only this user can read (mode 0700), as pyspark's do.
"""

from __future__ import annotations

import datetime
import functools
import logging
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from sparktrain.distributor import (
    AGENT_STORE,
    check_return_annotation,
    launch,
    script_path,
)

log = logging.getLogger(__name__)

_GPU_AMOUNT = "spark.task.resource.gpu.amount"
_DRIVER_GPU_AMOUNT = "spark.driver.resource.gpu.amount"


class TorchDistributor:
    """Distributed PyTorch training on Spark, called as pyspark's ``TorchDistributor``."""

    def __init__(self, num_processes: int = 1, local_mode: bool = True, use_gpu: bool = True):
        from pyspark.sql import SparkSession

        self.spark = SparkSession.active()  # raises when there is none, as pyspark's does
        self.num_processes = num_processes
        self.local_mode = local_mode
        self.use_gpu = use_gpu
        self.num_tasks = self._get_num_tasks()
        if self.num_processes <= 0:
            raise ValueError("num_processes has to be a positive integer")

    def _conf(self, key: str, default: str) -> str:
        return str(self.spark.conf.get(key, default))

    def _driver_gpus(self) -> list[str]:
        resources = self.spark.sparkContext.resources
        if "gpu" not in resources:
            raise RuntimeError("GPUs were unable to be found on the driver.")
        return list(resources["gpu"].addresses)

    def _get_num_tasks(self) -> int:
        if not self.use_gpu:
            return self.num_processes
        if not self.local_mode:
            amount = int(self._conf(_GPU_AMOUNT, "0"))
            if amount < 1:
                raise RuntimeError(f"'{_GPU_AMOUNT}' was unset, so gpu usage is unavailable.")
            if amount > 1 and self.num_processes % amount != 0:
                raise RuntimeError(
                    f"TorchDistributor 'num_processes' value ({self.num_processes}) must be "
                    f"a multiple of '{_GPU_AMOUNT}' ({amount}) value."
                )
            return self.num_processes // amount
        self._driver_gpus()
        available = int(self._conf(_DRIVER_GPU_AMOUNT, "0"))
        if available == 0:
            raise RuntimeError("GPU resources were not configured properly on the driver.")
        if self.num_processes > available:
            log.warning(
                "'num_processes' cannot be set to a value greater than the number of "
                "available GPUs on the driver, which is %d. 'num_processes' was reset to be "
                "equal to the number of available GPUs.",
                available,
            )
            self.num_processes = available
        return self.num_processes

    def run(self, train_object: Callable[..., Any] | str, *args: Any, **kwargs: Any) -> Any:
        """Run ``train_object(*args, **kwargs)`` on every rank and return rank 0's value,
        or run the Python file ``train_object`` with ``args`` and return ``None``."""
        if self.local_mode:
            return self._run_local(train_object, args, kwargs)
        from sparktrain.config import TrainConfig

        cfg = TrainConfig(num_workers=self.num_tasks)
        return launch(
            train_object, tuple(args), kwargs, cfg, self.spark, use_gpu=self.use_gpu or False
        )

    def _run_local(
        self, train_object: Callable[..., Any] | str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        env = {}
        if self.use_gpu:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self._driver_gpus()[: self.num_processes])
        if isinstance(train_object, str | os.PathLike):
            path = script_path(train_object, kwargs)
            run_local(self.num_processes, [path, *map(str, args)], env)
            return None
        if not callable(train_object):
            raise TypeError(
                "TorchDistributor.run takes a function or the path of a Python file, "
                f"got {type(train_object).__name__}"
            )
        check_return_annotation(train_object)
        from pyspark import cloudpickle

        with tempfile.TemporaryDirectory(prefix="sparktrain-torch-") as tmp:  # mode 0700
            fn_file = os.path.join(tmp, "fn.pkl")
            out_file = os.path.join(tmp, "out.pkl")
            with open(fn_file, "wb") as f:
                cloudpickle.dump((train_object, args, kwargs), f)
            worker = ["-m", "sparktrain.torch_distributor", fn_file, out_file]
            run_local(self.num_processes, worker, env)
            with open(out_file, "rb") as f:
                return pickle.load(f)  # written by this user's own rank 0, in a 0700 directory


def run_local(n: int, argv: list[str], extra_env: Mapping[str, str]) -> None:
    """Start ``n`` processes ``python argv...`` on this host as torchrun's standalone mode
    would, with the store on the loopback address only, and wait for them all; the first
    that fails stops the others and raises."""
    from sparktrain.comm_backend import bound_store
    from sparktrain.task.output import pump

    store = bound_store("127.0.0.1", n, datetime.timedelta(minutes=30))
    procs: list[subprocess.Popen[bytes]] = []
    pumps: list[threading.Thread] = []
    try:
        for rank in range(n):
            env = {
                **os.environ,
                **extra_env,
                "RANK": str(rank),
                "WORLD_SIZE": str(n),
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(n),
                "GROUP_RANK": "0",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(store.port),
                AGENT_STORE: "True",
            }
            pipe = subprocess.PIPE
            proc = subprocess.Popen([sys.executable, *argv], env=env, stdout=pipe, stderr=pipe)
            procs.append(proc)
            assert proc.stdout is not None and proc.stderr is not None
            # as pyspark's local mode: each line to the driver's current sys.stdout/stderr
            # (a notebook cell), named by its rank as sparktrain's tasks' lines are
            pumps.append(pump(proc.stdout, functools.partial(_say, rank, "out")))
            pumps.append(pump(proc.stderr, functools.partial(_say, rank, "err")))
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                raise RuntimeError(
                    f"TorchDistributor local training failed: rank {rank} exited with code "
                    f"{code} (its output is above)"
                )
            if all(c == 0 for c in codes):
                return
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for thread in pumps:
            thread.join(5.0)
        del store


def _say(rank: int, stream: str, text: str) -> None:
    """One line of a local rank's output, on the driver's stream as it is now."""
    target = sys.stderr if stream == "err" else sys.stdout
    target.write(f"[rank {rank}] {text}" if text.endswith("\n") else f"[rank {rank}] {text}\n")
    target.flush()


def _worker(fn_file: str, out_file: str) -> None:
    """One local rank: call the pickled function; rank 0 writes its value."""
    from sparktrain.distributor import _destroy_leftover_group, groups_kept_alive

    with open(fn_file, "rb") as f:
        fn, args, kwargs = pickle.load(f)  # written by this user's driver, in a 0700 directory
    with groups_kept_alive() as kept:
        try:
            value = fn(*args, **kwargs)
        finally:
            _destroy_leftover_group()
            kept.clear()
    if os.environ["RANK"] == "0":
        from pyspark import cloudpickle

        with open(out_file, "wb") as f:
            cloudpickle.dump(value, f)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
