"""The parameter server of a ``sparktrain.run`` job, started from inside the stage.

The built-in trainer builds the model on the driver and starts the server with it. A
``train_fn`` builds its model in the tasks, so the driver learns it from rank 0: in
``ctx.distributed(model, optimizer)`` rank 0 sends the trainable parameters (dtype,
size, rank 0's initial values), its ``sparse=True`` embedding tables (name, shape and
rows: the server holds them by rows, as for the built-in loop, docs/sparse_ps.md) and
the optimizer (its ``torch.optim`` class and the hyper-parameters of its one parameter
group) to the driver's :class:`Bootstrap`, which starts the server with them and
answers with the shards' addresses; rank 0 hands them to its peers. A resubmitted
stage finds the server already running (its model survives the failure) and continues
at the server's completed step.

Wire: one authenticated connection; JSON control frames, then the values in chunks
(no pickle).
"""

from __future__ import annotations

import contextlib
import inspect
import json
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from sparktrain.config import TrainConfig
from sparktrain.errors import CommError, ConfigError, WorkerError
from sparktrain.wire.chunked import chunk_bytes_for, recv_chunked_into, send_chunked
from sparktrain.wire.connection import Connection
from sparktrain.wire.frames import KIND_CONTROL
from sparktrain.wire.handshake import DRIVER_RANK, connect
from sparktrain.wire.security import WireSecurity
from sparktrain.wire.service import DriverService
from sparktrain.wire.stats import CommStats

HEAD_MAX_BYTES = 1 << 20
_DTYPES = {"float32": np.float32, "float64": np.float64}
# per-group keys that are not hyper-parameters of the update
_NOT_HYPER = ("params", "lr", "initial_lr", "name")
# a served table as it travels: (name, [rows, dim] values)
Table = tuple[str, np.ndarray]


def optimizer_spec(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer as the server rebuilds it: its ``torch.optim`` class, rate and
    hyper-parameters (JSON: lists for tuples such as Adam's betas)."""
    cls = type(optimizer).__mro__
    name = next((c.__name__ for c in cls if getattr(torch.optim, c.__name__, None) is c), None)
    if name is None or name == "Optimizer":
        raise ConfigError(
            f"strategy='ps' rebuilds the optimizer in the driver's server from its class: "
            f"{type(optimizer).__name__} is not a torch.optim optimizer; use one of "
            "torch.optim's (SGD, Adam, AdamW, ...) or strategy='ring'"
        )
    if len(optimizer.param_groups) != 1:
        raise ConfigError(
            f"strategy='ps' takes an optimizer with one parameter group, this one has "
            f"{len(optimizer.param_groups)}: use strategy='ring' for per-group settings"
        )
    group = optimizer.param_groups[0]
    # what the constructor takes (a group also holds derived keys, e.g. AdamW's
    # decoupled_weight_decay, that the constructor sets itself)
    accepted = set(inspect.signature(getattr(torch.optim, name).__init__).parameters)
    hyper = {}
    for key, value in group.items():
        if key in _NOT_HYPER or key not in accepted or value is None:
            continue
        if isinstance(value, torch.Tensor):
            value = value.item() if value.numel() == 1 else value.tolist()
        if isinstance(value, tuple):
            value = list(value)
        json.dumps(value)  # the group holds JSON-able values only, or this says which
        hyper[key] = value
    return {"class": name, "lr": float(group["lr"]), "kwargs": hyper}


def server_config(cfg: TrainConfig, spec: dict[str, Any]) -> TrainConfig:
    """``cfg`` with the optimizer of ``spec`` (:func:`optimizer_spec`) as the server's."""
    return cfg.replace(
        optimizer=_TorchOptimizer(str(spec["class"]), dict(spec["kwargs"])),
        lr=float(spec["lr"]),
        optimizer_kwargs={},
    )


class _TorchOptimizer:
    """``(params, lr) -> torch.optim.<name>(params, lr=lr, **kwargs)``, picklable."""

    def __init__(self, name: str, kwargs: dict[str, Any]) -> None:
        cls = getattr(torch.optim, name, None)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise ConfigError(f"the workers named optimizer {name!r}, not a torch.optim class")
        self.cls: Any = cls
        self.kwargs = kwargs
        self.__name__ = name

    def __call__(self, params: Any, lr: float) -> torch.optim.Optimizer:
        kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in self.kwargs.items()}
        optimizer: torch.optim.Optimizer = self.cls(params, lr=lr, **kwargs)
        return optimizer


class Bootstrap(DriverService):
    """Starts the job's parameter server when rank 0 describes the model (see the module
    docstring); ``start`` builds it from (values, config), ``current`` gives the running
    one's (addresses, completed step) or None; ``start`` takes (flat values, config,
    row-served tables)."""

    name = "ps-bootstrap"

    def __init__(
        self,
        host: str,
        *,
        secret: bytes,
        job_id: str,
        attempt: Callable[[], int],
        security: WireSecurity | None,
        start: Callable[[np.ndarray, TrainConfig, list[Table]], None],
        current: Callable[[], tuple[list[str], int | None] | None],
        config: TrainConfig,
    ) -> None:
        self._start_server = start
        self._current = current
        self._config = config
        super().__init__(host, secret=secret, job_id=job_id, attempt=attempt, security=security)
        self.start()

    def handle(self, conn: Connection) -> None:
        with conn:
            try:
                self._serve(conn)
            except (CommError, OSError, ValueError, KeyError, TypeError, ConfigError) as exc:
                with contextlib.suppress(CommError, OSError):
                    conn.send_bytes(json.dumps({"error": str(exc)}).encode(), KIND_CONTROL)

    def _serve(self, conn: Connection) -> None:
        if conn.peer_rank != 0:
            raise ValueError(f"rank {conn.peer_rank} asked; rank 0 describes the model")
        _, raw = conn.recv_bytes(KIND_CONTROL, max_bytes=HEAD_MAX_BYTES)
        head = json.loads(raw)
        running = self._current()
        if running is None:
            dtype = _DTYPES[str(head["dtype"])]
            values = np.empty(int(head["elements"]), dtype=dtype)
            conn.send_bytes(b'{"values": true}', KIND_CONTROL)
            recv_chunked_into(conn, values, int(head["chunk_bytes"]))
            tables = []
            for name, shape in _table_shapes(head.get("tables", [])):
                rows = np.empty(shape, dtype=dtype)
                recv_chunked_into(conn, rows.reshape(-1), int(head["chunk_bytes"]))
                tables.append((name, rows))
            self._start_server(values, server_config(self._config, head["optimizer"]), tables)
            running = self._current()
            assert running is not None
        else:
            conn.send_bytes(b'{"values": false}', KIND_CONTROL)
        addresses, step = running
        conn.send_bytes(json.dumps({"addresses": addresses, "step": step}).encode(), KIND_CONTROL)


def _table_shapes(raw: Any) -> list[tuple[str, tuple[int, int]]]:
    """The head's ``tables`` (``[[name, rows, dim], ...]``), checked: names are strings,
    shapes positive."""
    if not isinstance(raw, list):
        raise ValueError(f"the head's tables must be a list, not {type(raw).__name__}")
    out = []
    for entry in raw:
        name, rows, dim = entry
        if not isinstance(name, str) or not all(isinstance(v, int) and v > 0 for v in (rows, dim)):
            raise ValueError(f"a served table must be [name, rows > 0, dim > 0], not {entry!r}")
        out.append((name, (rows, dim)))
    return out


def request_server(
    address: str,
    flat: np.ndarray,
    optimizer: dict[str, Any],
    *,
    tables: Sequence[Table] = (),
    secret: bytes,
    job_id: str,
    attempt: int,
    timeout: float,
    security: WireSecurity | None,
) -> tuple[list[str], int | None]:
    """Rank 0's side: describe the model (``flat``: the dense parameters; ``tables``:
    the row-served embedding tables, same dtype) to the driver; returns the shards'
    addresses and the server's completed step (None: a fresh server)."""
    with connect(
        address,
        secret=secret,
        job_id=job_id,
        attempt=attempt,
        my_rank=0,
        peer_rank=DRIVER_RANK,
        timeout=timeout,
        stats=CommStats(),
        security=security,
    ) as conn:
        step = chunk_bytes_for(conn.max_frame_bytes)
        head = {
            "dtype": str(flat.dtype),
            "elements": int(flat.size),
            "optimizer": optimizer,
            "chunk_bytes": step,
            "tables": [[name, int(rows.shape[0]), int(rows.shape[1])] for name, rows in tables],
        }
        conn.send_bytes(json.dumps(head).encode(), KIND_CONTROL)
        reply = _reply(conn)
        if reply.get("values"):
            send_chunked(conn, flat, step)
            for _, rows in tables:
                send_chunked(conn, np.ascontiguousarray(rows).reshape(-1), step)
            reply = _reply(conn)
        else:
            reply = _reply(conn)
    completed = reply.get("step")
    return [str(a) for a in reply["addresses"]], None if completed is None else int(completed)


def _reply(conn: Connection) -> dict[str, Any]:
    _, raw = conn.recv_bytes(KIND_CONTROL, max_bytes=HEAD_MAX_BYTES)
    reply = json.loads(raw)
    if "error" in reply:
        raise WorkerError(f"the driver could not start the parameter server: {reply['error']}")
    return dict(reply)
