"""``sparktrain.torch_run``: code written for pyspark's ``TorchDistributor`` runs unchanged.

>>> def train(lr):  # doctest: +SKIP
...     import torch.distributed as dist
...     dist.init_process_group("gloo")  # env://: RANK, WORLD_SIZE, MASTER_ADDR/PORT
...     model = torch.nn.parallel.DistributedDataParallel(make_model())
...     ...
...     return model.module.state_dict()
>>> state = sparktrain.torch_run(train, 0.01, num_workers=2)  # doctest: +SKIP

Every task of one barrier stage (the stage runner of :func:`sparktrain.run`, with its
restarts and progress) calls ``fn(*args)`` with the environment torch's ``env://``
initialisation reads. Rank 0 starts torch's ``TCPStore`` server itself, listening on
its own task address only (torch's ``init_process_group`` would bind every interface);
the address and port reach the other ranks through sparktrain's authenticated
all-gather, not through anything a stranger could answer, and every rank's
``init_process_group`` connects to that store as a client
(``TORCHELASTIC_USE_AGENT_STORE=True``, as under torchrun). The store and Gloo/NCCL are
still neither authenticated nor encrypted, so ``torch_run`` is refused whenever
encryption is required (docs/security.md).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import hmac
import inspect
import json
import logging
import os
import secrets
import socket
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from sparktrain.comm_backend import check_torch_transport
from sparktrain.config import TrainConfig

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from sparktrain.task.run_context import RunContext

log = logging.getLogger(__name__)

ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""What ``torch.distributed``'s ``env://`` initialisation and ``torchrun`` scripts read."""


OWN_KEYWORDS = ("num_workers", "config", "spark")
""":func:`torch_run`'s own keyword options: any other keyword goes to ``fn``."""


def torch_run(
    fn: Callable[..., Any] | str,
    *args: Any,
    num_workers: int | None = None,
    config: TrainConfig | None = None,
    spark: SparkSession | None = None,
    **kwargs: Any,
) -> Any:
    """Call ``fn(*args, **kwargs)`` in each of ``num_workers`` tasks of one barrier stage,
    as ``TorchDistributor(num_processes=num_workers).run(fn, *args, **kwargs)`` would,
    and return rank 0's return value; or, ``fn`` being the path of a Python file, run it
    with ``args`` as its command line on every rank and return ``None``. A keyword of
    torch_run's own (``num_workers``, ``config``, ``spark``) that ``fn`` also names is
    refused (:class:`sparktrain.TorchDistributor` gives every keyword to ``fn``).

    Each call sees ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
    ``MASTER_ADDR`` and ``MASTER_PORT`` (rank 0's task address and the port of the
    store rank 0 serves there, on that address only) and
    ``TORCHELASTIC_USE_AGENT_STORE=True``, so
    ``torch.distributed.init_process_group(backend)`` with the default ``env://``
    works and every rank joins that store; the environment is restored afterwards,
    and a process group ``fn`` left initialised is destroyed. Tensors, state dicts,
    numbers, strings, lists and string-keyed dicts travel back without pickle (tuples
    come back as lists), as with :func:`sparktrain.run`; other values are pickled and
    signed, over the authenticated state receiver only (:func:`wrap_value`).
    ``config`` supplies ``num_workers``, ``max_restarts`` (a
    lost task resubmits the stage: ``fn`` starts again on every rank; an exception
    ``fn`` raises is final, a :class:`~sparktrain.errors.UserCodeError` with the rank's
    traceback), ``progress``, ``stream_output`` (what ``fn`` or the script prints
    reaches the driver's ``sys.stdout``/``sys.stderr`` as ``[rank r] ...``),
    ``comm_timeout`` and the security settings; ``strategy`` must stay ``"ring"`` or
    ``"tree"`` (the ranks meet over it; ``fn`` does its own communication).

    Raises :class:`~sparktrain.errors.ResourceError` when the config or Spark requires
    encryption: torch's store and collectives cannot provide it.
    """
    given = {"num_workers": num_workers, "config": config, "spark": spark}
    _check_own_keywords(fn, {k for k, v in given.items() if v is not None})
    if config is not None and not isinstance(config, TrainConfig):
        raise TypeError(
            f"torch_run's config= takes a sparktrain.TrainConfig, got {type(config).__name__}; "
            "to pass a keyword named 'config' to fn, use "
            "sparktrain.TorchDistributor(...).run(fn, config=...)"
        )
    cfg = config or TrainConfig()
    if num_workers is not None:
        cfg = cfg.replace(num_workers=num_workers)
    return launch(fn, args, kwargs, cfg, spark, use_gpu=None)


def _check_own_keywords(fn: Callable[..., Any] | str, given: set[str]) -> None:
    """Refuse a keyword of torch_run's own that ``fn`` also names as a parameter: it would
    go to torch_run, silently, not to ``fn``."""
    if isinstance(fn, str) or not given:
        return
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return
    clash = sorted(n for n in given if n in params and params[n].kind != params[n].VAR_KEYWORD)
    if clash:
        raise TypeError(
            f"torch_run(..., {clash[0]}=...) is torch_run's own option, and fn also takes a "
            f"parameter {clash[0]!r}: it is ambiguous. Pass fn's keywords through "
            "sparktrain.TorchDistributor(num_processes=N, local_mode=False, use_gpu=False)"
            f".run(fn, {clash[0]}=...), whose run() gives every keyword to fn"
        )


def launch(
    fn: Callable[..., Any] | str,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    cfg: TrainConfig,
    spark: SparkSession | None,
    *,
    use_gpu: bool | None,
) -> Any:
    """Run ``fn`` (a function, or the path of a Python file) on ``cfg.num_workers``
    barrier tasks and return rank 0's value (``None`` for a file). ``use_gpu=False``
    hides the GPUs from the tasks (``CUDA_VISIBLE_DEVICES=""``, as TorchDistributor
    does); ``None`` leaves the variable alone."""
    from sparktrain.runner import run

    if isinstance(fn, str | os.PathLike):
        path = script_path(fn, kwargs)
        entry: TorchEntry = TorchEntry(path, tuple(args), {}, use_gpu=use_gpu)
    elif callable(fn):
        check_return_annotation(fn)
        entry = TorchEntry(fn, tuple(args), dict(kwargs), use_gpu=use_gpu)
    else:
        raise TypeError(
            f"torch_run takes a function or the path of a Python file, got {type(fn).__name__}"
        )
    from sparktrain.driver.job import check_job

    check_job(cfg, "torch_run")  # not the ps: it would start a server fn never uses
    session = spark
    if session is None:
        from sparktrain.session import get_or_create_session

        session = get_or_create_session()
    from sparktrain.driver.resources import spark_wire_encryption
    from sparktrain.driver.spark_env import spark_env

    check_torch_transport(spark_wire_encryption(spark_env(session)), cfg, "torch_run")
    value = run(entry, config=cfg, spark=session).value
    return unwrap_value(value, entry.key)


class TorchEntry:
    """The ``train_fn`` :func:`torch_run` hands to the stage runner: rank 0 starts the
    store on its own address, the ranks meet through the authenticated all-gather, set
    the environment, call ``fn(*args, **kwargs)`` or run the Python file ``fn`` with
    ``args`` as its command line."""

    def __init__(
        self,
        fn: Callable[..., Any] | str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None = None,
        *,
        use_gpu: bool | None = None,
    ) -> None:
        self.fn = fn
        self.args = args
        self.kwargs = kwargs or {}
        self.use_gpu = use_gpu
        self.key = secrets.token_bytes(32)  # signs a pickled return value (see wrap_value)

    def __call__(self, ctx: RunContext) -> Any:
        task = ctx.task
        # Rank 0 serves the store itself, on its own address: left to fn's
        # init_process_group, torch would bind every interface.
        store = _open_store(task.host, ctx.world_size) if ctx.rank == 0 else None
        port = 0 if store is None else int(store.port)
        mine = json.dumps({"host": task.host, "port": port})
        peers = [json.loads(s) for s in task.all_gather(mine)]
        env = {
            **torch_env(ctx.rank, [p["host"] for p in peers], peers[0]["port"]),
            AGENT_STORE: "True",
        }
        if self.use_gpu is False:
            env["CUDA_VISIBLE_DEVICES"] = ""  # as TorchDistributor(use_gpu=False) does
        try:
            with patched_env(env):
                if isinstance(self.fn, str):
                    run_script(self.fn, self.args, rank=ctx.rank)
                    return None
                with groups_kept_alive() as kept:
                    try:
                        value = self.fn(*self.args, **self.kwargs)
                    finally:
                        _destroy_leftover_group()
                        kept.clear()  # the groups' destructors run here, without the GIL
            if ctx.rank != 0:  # the driver keeps rank 0's value only
                return value if is_plain(value) else None
            job = getattr(task, "job", None)
            streamed = getattr(job, "state_address", None) is not None
            return wrap_value(value, self.key, streamed=streamed)
        finally:
            del store  # the server stops with rank 0's fn (as it would inside fn)


def script_path(path: str | os.PathLike[str], kwargs: Mapping[str, Any]) -> str:
    """The absolute path of the user's Python file, checked on the driver."""
    if kwargs:
        raise ValueError("Running pytorch file does not support key-word type arguments.")
    full = os.path.abspath(os.fspath(path))
    if not os.path.isfile(full):
        raise FileNotFoundError(
            f"the training script {os.fspath(path)!r} is not a file on the driver ({full}); "
            "pass the path of a Python file that every executor can read at the same path"
        )
    return full


def run_script(path: str, args: Sequence[Any], *, rank: int) -> None:
    """Run the user's file as torchrun would run it on one rank: a fresh Python with the
    rank's environment (already in ``os.environ``) and ``args`` as its command line."""
    import subprocess
    import sys

    from sparktrain.task import output

    if not os.path.isfile(path):
        raise FileNotFoundError(f"rank {rank}: the training script {path} is not on this host")
    argv = [sys.executable, path, *map(str, args)]
    if not output.captured():  # stream_output off: the script writes to the task's own fds
        code = subprocess.call(argv, env=dict(os.environ))
    else:  # its lines go through the task's streams to the driver (stream_output)
        pipe = subprocess.PIPE
        child = subprocess.Popen(argv, env=dict(os.environ), stdout=pipe, stderr=pipe)
        assert child.stdout is not None and child.stderr is not None
        pumps = [
            output.pump(child.stdout, sys.stdout.write),
            output.pump(child.stderr, sys.stderr.write),
        ]
        try:
            code = child.wait()
        finally:
            if child.poll() is None:  # the task is ending some other way: no orphan
                child.kill()
                child.wait()
            for thread in pumps:  # the pumps close the pipes once they read their end
                thread.join(5.0)  # unless a grandchild holds them open
    if code != 0:
        raise RuntimeError(f"rank {rank}: {path} exited with code {code}")


PICKLED_KEY = "__sparktrain_pickled__"
"""The key of rank 0's pickled return value: one uint8 tensor, a 32-byte HMAC then the
pickle."""


def is_plain(value: Any) -> bool:
    """Whether ``value`` travels as JSON plus tensors (what :func:`sparktrain.run` returns)."""
    import numpy as np
    import torch

    if value is None or isinstance(value, bool | int | float | str | np.generic):
        return True
    if isinstance(value, torch.Tensor | np.ndarray):
        return True
    if isinstance(value, Mapping):
        return all(isinstance(k, str) and is_plain(v) for k, v in value.items()) and (
            set(value) != {PICKLED_KEY}
        )
    if isinstance(value, list | tuple):
        return all(is_plain(v) for v in value)
    return False


def wrap_value(value: Any, key: bytes, *, streamed: bool) -> Any:
    """Rank 0's return value as the stage runner carries it: unchanged when it is plain;
    otherwise pickled (cloudpickle) and signed with ``key``, but only when its tensors go
    to the driver's state receiver, whose connection is authenticated. Through Spark's
    task results (the tasks could not reach the receiver) no pickle travels."""
    if is_plain(value):
        return value
    if not streamed:
        from sparktrain import errors

        raise errors.ConfigError(
            f"fn returned a {type(value).__name__}, which only pickle carries, and this run "
            "returns its value through Spark's task results, a channel sparktrain does not "
            "authenticate, where no pickle travels: return tensors, state dicts, numbers, "
            "strings, lists or dicts with string keys (model.state_dict(), not the model)"
        )
    import numpy as np
    import torch
    from pyspark import cloudpickle

    blob = cloudpickle.dumps(value)
    tag = hmac.new(key, blob, hashlib.sha256).digest()
    return {PICKLED_KEY: torch.from_numpy(np.frombuffer(tag + blob, dtype=np.uint8).copy())}


def unwrap_value(value: Any, key: bytes) -> Any:
    """The driver's half of :func:`wrap_value`: unpickle only what carries ``key``'s HMAC."""
    if not (isinstance(value, dict) and set(value) == {PICKLED_KEY}):
        return value
    import pickle

    raw = value[PICKLED_KEY].numpy().tobytes()
    tag, blob = raw[:32], raw[32:]
    if not hmac.compare_digest(tag, hmac.new(key, blob, hashlib.sha256).digest()):
        from sparktrain import errors

        raise errors.HandshakeError(
            "rank 0's pickled return value does not carry this run's signature: not unpickled"
        )
    return pickle.loads(blob)  # signed by this run's own rank 0


UNPICKLABLE = ("Generator", "Iterator", "AsyncGenerator", "Coroutine", "GeneratorType")


def check_return_annotation(fn: Callable[..., Any]) -> None:
    """Refuse, before training, a function whose return annotation names a type neither
    JSON nor pickle can carry (a generator, an iterator, a coroutine)."""
    try:
        ret = inspect.signature(fn).return_annotation
    except (TypeError, ValueError):
        return
    if ret is inspect.Signature.empty:
        return
    name = ret if isinstance(ret, str) else getattr(ret, "__name__", None) or str(ret)
    base = str(name).split("[", 1)[0].rsplit(".", 1)[-1]
    if base in UNPICKLABLE:
        raise TypeError(
            f"fn is annotated to return {name}, which cannot travel back to the driver: "
            "return its values (a list), a state dict or a tensor"
        )


AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
"""With it ``"True"`` (as torchrun's agent sets it), torch's ``env://`` and ``tcp://``
initialisation connects every rank, rank 0 included, as a client of the store at
``MASTER_ADDR:MASTER_PORT`` instead of starting one in rank 0: here, the one
:func:`_open_store` started on rank 0's own address."""


def _open_store(host: str, world_size: int) -> Any:
    """Rank 0's store server on ``host`` only (:func:`~sparktrain.comm_backend.bound_store`).
    Its timeout is torch's default for a process group's store: it bounds only the
    server's own client, which ``fn`` does not use (each rank's ``init_process_group``
    connects a client of its own, with ``fn``'s timeout)."""
    from torch.distributed.constants import default_pg_timeout

    from sparktrain.comm_backend import bound_store

    return bound_store(host, world_size, default_pg_timeout)


def free_port(host: str) -> int:
    """A TCP port free on ``host`` right now (bound to that address, never a wildcard).

    The socket closes before anyone binds the port again: a small race. :class:`TorchEntry`
    no longer needs it (rank 0's store keeps its listening socket open)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def torch_env(rank: int, hosts: Sequence[str], master_port: int) -> dict[str, str]:
    """The environment of ``rank`` given every rank's task address (rank 0's is the
    master): ``LOCAL_RANK`` counts the ranks before this one on the same address,
    ``LOCAL_WORLD_SIZE`` those on it."""
    if not 0 <= rank < len(hosts):
        raise ValueError(f"rank {rank} outside a world of {len(hosts)}")
    if not 0 < master_port < 65536:
        raise ValueError(f"MASTER_PORT {master_port} is not a port")
    mine = hosts[rank]
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(len(hosts)),
        "LOCAL_RANK": str(sum(1 for h in hosts[:rank] if h == mine)),
        "LOCAL_WORLD_SIZE": str(sum(1 for h in hosts if h == mine)),
        "MASTER_ADDR": hosts[0],
        "MASTER_PORT": str(master_port),
    }


@contextlib.contextmanager
def patched_env(env: Mapping[str, str]) -> Iterator[None]:
    """Set ``env`` in ``os.environ`` for the block, then put back what was there (a
    reused Python worker must not carry one job's ranks into the next)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def groups_kept_alive() -> Iterator[list[Any]]:
    """Inside the block, every default process group ``init_process_group`` makes is also
    held in the yielded list, until the caller clears it.

    A DDP module holds its group through its C++ reducer, and when ``fn`` returns and
    the module is freed, the reducer frees the group while holding the GIL (torch's
    reducer binding does not release it). Gloo's destructor then joins its worker
    threads, and one of them may still be destroying the last collective's work, which
    needs the GIL to drop its tensors: the task deadlocks (measured: 1 call in 5 of a
    DDP function ending in ``broadcast_object_list``; pytorch/pytorch#56297). With the
    list holding the group, the reducer's is never the last reference; clearing the
    list frees the group through torch's Python binding, which releases the GIL first.
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    kept: list[Any] = []
    original = distributed_c10d.init_process_group

    @functools.wraps(original)
    def init_and_keep(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        kept.append(distributed_c10d._get_default_group())
        return out

    patched = [(m, "init_process_group") for m in (dist, distributed_c10d)]
    saved = [getattr(m, name) for m, name in patched]
    for m, name in patched:
        setattr(m, name, init_and_keep)
    try:
        yield kept
    finally:
        for (m, name), value in zip(patched, saved, strict=True):
            setattr(m, name, value)


def _destroy_leftover_group() -> None:
    """A process group ``fn`` left initialised would make the next ``init_process_group``
    in this (reused) Python worker fail: destroy it."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as exc:  # the task's outcome is fn's; this is cleanup
            log.warning("could not destroy the process group fn left behind: %s", exc)
