"""torch's ``TCPStore`` under ``comm_backend = "torch"`` and ``torch_run`` listens on the
task's own address only, never on every interface (issue 31, point 5).

Given only a host and a port, torch's store server binds ``*:port`` (0.0.0.0 or ::)
whatever host it is given; sparktrain hands it a socket already listening on the task's
address. Each test starts the store as the code does, on 127.0.0.1, reads this process's
listeners from /proc and checks that a client on the bound address gets through. No
Spark: a world of one rank, the all-gather faked.
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

from sparktrain.comm_backend import bound_store
from sparktrain.distributor import AGENT_STORE, TorchEntry
from sparktrain.strategies.allreduce.task_torch import init_process_group
from tests.proc_net import bound_to

HOST = "127.0.0.1"
TIMEOUT = datetime.timedelta(seconds=20)


class _Task:
    """What the store's start reads of a WorkerContext: rank, world, host, all-gather."""

    host = HOST
    rank = 0
    world_size = 1

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    def all_gather(self, message: str) -> list[str]:
        self.sent.append(json.loads(message))
        return [message]


class _RunCtx:
    rank = 0
    world_size = 1

    def __init__(self) -> None:
        self.task = _Task()


@pytest.fixture(autouse=True)
def _no_group_left() -> Any:
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _client_round_trip(port: int) -> bytes:
    client = dist.TCPStore(HOST, port, is_master=False, timeout=TIMEOUT)
    client.set("probe", "through the bound address")
    return bytes(client.get("probe"))


def test_bound_store_listens_on_the_given_address_only() -> None:
    store = bound_store(HOST, 1, TIMEOUT)
    assert bound_to(store.port) == [HOST]
    assert _client_round_trip(store.port) == b"through the bound address"
    assert store.get("probe") == b"through the bound address"


def test_comm_backend_torch_store_listens_on_the_task_address_only() -> None:
    task = _Task()
    assert init_process_group(task, None, 20.0) == "gloo"  # type: ignore[arg-type]
    port = int(task.sent[0]["port"])
    assert bound_to(port) == [HOST]  # not 0.0.0.0 or ::
    assert _client_round_trip(port) == b"through the bound address"
    total = torch.ones(3)
    dist.all_reduce(total)  # the group formed over that store
    assert total.tolist() == [1.0, 1.0, 1.0]


def test_torch_run_store_listens_on_the_task_address_only() -> None:
    seen: dict[str, Any] = {}

    def fn() -> int:  # written for TorchDistributor: env:// from the environment
        dist.init_process_group("gloo")
        port = int(os.environ["MASTER_PORT"])
        seen["bound"] = bound_to(port)
        seen["client"] = _client_round_trip(port)
        seen["agent_store"] = os.environ.get(AGENT_STORE)
        return dist.get_world_size()

    ctx = _RunCtx()
    assert TorchEntry(fn, ())(ctx) == 1  # type: ignore[arg-type]
    assert seen["bound"] == [HOST]
    assert seen["client"] == b"through the bound address"
    assert seen["agent_store"] == "True"
    assert AGENT_STORE not in os.environ  # restored for the reused worker
    port = int(ctx.task.sent[0]["port"])
    assert bound_to(port) == []  # the store stopped with rank 0's fn
