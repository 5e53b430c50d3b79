"""The torch backend's two collectives in two processes on 127.0.0.1 (process groups
do not run as threads): the plain sum, and a compressed bucket through torch's DDP hooks
giving the sum, with the row count summed on the side."""

from __future__ import annotations

import datetime
import socket
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sparktrain.comm_backend import hook_spec
from sparktrain.strategies.allreduce.task_torch import (
    HookReducer,
    TorchSumAllreduce,
    _HookBucket,
    collective_device,
)


def _rank(rank: int, port: int, results: Any, backend: str = "gloo") -> None:
    store = dist.TCPStore(
        "127.0.0.1", port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=30)
    )
    # NCCL's path: a copy on the collective device, reduced there, copied back; under
    # Gloo the CPU stands in for the GPU
    via = torch.device("cpu")
    if backend == "nccl":
        via = torch.device("cuda", rank)
        torch.cuda.set_device(via)
    dist.init_process_group(backend, store=store, rank=rank, world_size=2)
    try:
        out: dict[str, Any] = {}
        if backend == "gloo":
            buf = np.full(5, rank + 1.0)
            TorchSumAllreduce().allreduce_(buf)
            out["plain"] = buf.tolist()
        buf = np.full(5, rank + 1.0)
        TorchSumAllreduce(via).allreduce_(buf)
        out["plain via device"] = buf.tolist()
        for spec in ("fp16", "bf16", "powersgd:1+ef"):
            devices = ((spec, None),) if backend == "gloo" else ()
            for key, device in (*devices, (f"{spec} via device", via)):
                reducer = HookReducer(hook_spec(spec), last_index=0, seed=0, device=device)  # type: ignore[arg-type]
                for _ in range(3):  # PowerSGD compresses from its second step on
                    grads = _rank_one() * (rank + 1)
                    total = reducer.reduce_(0, grads, 10.0 + rank, shapes=[(8, 8)])
                out[key] = (grads.tolist(), total)
            if reducer.state is not None:  # PowerSGD: did its compressed path run?
                out["powersgd_compressed"] = reducer.state.total_numel_after_compression
        results.put((rank, out))
    finally:
        dist.destroy_process_group()


def _rank_one() -> torch.Tensor:
    """An 8x8 matrix of rank one: PowerSGD (rank 1) compresses it 4x and, warm-started,
    recovers it; a sum of two multiples of it is rank one too."""
    u = torch.arange(1, 9, dtype=torch.float32)
    return torch.outer(u, u).flatten()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_ranks(backend: str) -> dict[int, dict[str, Any]]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, queue, backend)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        return dict(queue.get(timeout=60) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


@pytest.fixture(scope="module")
def results() -> dict[int, dict[str, Any]]:
    return _run_ranks("gloo")


@pytest.mark.parametrize("key", ["plain", "plain via device"])
def test_plain_sum(results: dict[int, dict[str, Any]], key: str) -> None:
    assert results[0][key] == results[1][key] == [3.0] * 5


def test_nccl_only_for_a_cuda_model_and_when_torch_has_it() -> None:
    cuda = torch.device("cuda", 1)
    assert collective_device(cuda, nccl=True) == cuda
    assert collective_device(cuda, nccl=False) is None  # Gloo on the host buckets
    assert collective_device(torch.device("cpu"), nccl=True) is None


@pytest.mark.parametrize("via", ["", " via device"])
@pytest.mark.parametrize(
    ("spec", "rtol"), [("fp16", 1e-3), ("bf16", 1e-2), ("powersgd:1+ef", 1e-3)]
)
def test_hooks_give_the_sum_and_the_rows(
    results: dict[int, dict[str, Any]], spec: str, rtol: float, via: str
) -> None:
    want = (_rank_one() * 3).tolist()
    for rank in (0, 1):
        grads, total = results[rank][spec + via]
        assert total == 21.0
        assert np.allclose(grads, want, rtol=rtol, atol=0), (spec, grads)


def test_powersgd_compressed(results: dict[int, dict[str, Any]]) -> None:
    assert results[0]["powersgd_compressed"] == 16  # P (8x1) and Q (8x1), not 64


def test_hook_bucket_views_share_the_buffer() -> None:
    buf = torch.zeros(7)
    bucket = _HookBucket(3, buf, [(2, 2), (3,)], last=True)
    a, b = bucket.gradients()
    a.fill_(1.0)
    b.fill_(2.0)
    assert buf.tolist() == [1.0] * 4 + [2.0] * 3
    assert bucket.index() == 3 and bucket.is_last()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a GPU per rank: fewer than 2")
def test_nccl_sums_host_buckets_on_the_gpus() -> None:
    results = _run_ranks("nccl")
    for rank in (0, 1):
        assert results[rank]["plain via device"] == [3.0] * 5
        grads, total = results[rank]["fp16 via device"]
        assert total == 21.0
        assert np.allclose(grads, (_rank_one() * 3).tolist(), rtol=1e-3, atol=0)
