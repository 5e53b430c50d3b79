"""Device staging (task/staging.py) with a fake device: its "device" tensors are CPU
tensors and its copies to the host run on a thread, so the CPU checks that staged
training gives the bits of the plain path and that the copies overlap the backward."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch
from torch import nn

import sparktrain.task.step_sync as sync_module
from sparktrain.task.staging import DeviceStaging, staging_device
from tests.unit.fixtures import loop_spec, random_parts, train_in_threads


class FakeDevice:
    """A :class:`~sparktrain.task.staging.StagingDevice` whose copies to the host run
    on a thread of their own (a side stream's stand-in), each recorded with its times."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="fake-side-stream")
        self.copies: list[dict[str, float | str | int]] = []
        self.to_device_calls = 0
        self._lock = threading.Lock()

    def pinned(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype)

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype)

    def to_host_async(self, dst: torch.Tensor, src: torch.Tensor) -> Future[None]:
        queued = time.perf_counter()
        snapshot = src.clone()  # what the device holds when the copy is queued

        def copy() -> None:
            started = time.perf_counter()
            time.sleep(self.delay_s)
            dst.copy_(snapshot)
            with self._lock:
                self.copies.append(
                    {
                        "queued": queued,
                        "started": started,
                        "ended": time.perf_counter(),
                        "thread": threading.current_thread().name,
                        "dtype": str(src.dtype),
                    }
                )

        return _Waitable(self.pool.submit(copy))

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.to_device_calls += 1
        dst.copy_(src)


class _Waitable:
    def __init__(self, future: Future[None]) -> None:
        self.future = future

    def wait(self) -> None:
        self.future.result(timeout=30)


def _with_fake_device(monkeypatch, delay_s: float = 0.0) -> list[FakeDevice]:
    made: list[FakeDevice] = []

    def fake(params):
        made.append(FakeDevice(delay_s))
        return made[-1]

    monkeypatch.setattr(sync_module, "staging_device", fake)
    return made


def _stats(outputs):
    return [json.loads(r.data) for out in outputs for r in out if r.kind == "stats"]


def test_no_staging_on_the_cpu():
    assert staging_device(list(nn.Linear(2, 2).parameters())) is None


@pytest.mark.parametrize("compression", ["none", "fp16", "bf16", "topk:0.5+ef"])
@pytest.mark.parametrize("overlap", [True, False])
def test_staged_training_gives_the_bits_of_the_plain_path(monkeypatch, compression, overlap):
    parts = random_parts([13, 6])
    spec = loop_spec(compression=compression, overlap=overlap, batch_size=4, bucket_mb=1e-4)
    plain = {s["param_digest"] for s in _stats(train_in_threads(spec, parts))}
    made = _with_fake_device(monkeypatch)
    stats = _stats(train_in_threads(spec, parts))
    assert {s["param_digest"] for s in stats} == plain and len(plain) == 1
    assert len(made) == 2 and all(d.copies and d.to_device_calls for d in made)
    assert all(s["staged_to_host_bytes"] > 0 for s in stats)
    if compression in ("fp16", "bf16"):  # cast on the device, half the bytes copied
        want = {"torch.float16" if compression == "fp16" else "torch.bfloat16"}
        assert {c["dtype"] for d in made for c in d.copies} == want
        assert all(s["staged_to_host_bytes"] * 2 == s["staged_to_device_bytes"] for s in stats)


def test_copies_to_the_host_overlap_the_backward():
    """Bucket by bucket from the gradient hooks: the last layer's copy is queued and
    running on the side thread while the backward of the first layers still runs."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 512), nn.Linear(512, 4))
    params = list(model.parameters())
    groups = [params[4:], params[2:4], params[0:2]]  # the order backward completes them
    device = FakeDevice(delay_s=0.002)
    hosts = [torch.zeros(sum(p.numel() for p in g)) for g in groups]
    staging = DeviceStaging(device, [(g, h, "none") for g, h in zip(groups, hosts, strict=True)])
    remaining = [len(g) for g in groups]

    def hook_for(i):
        def hook(p):
            remaining[i] -= 1
            if remaining[i] == 0:
                staging.start(i)

        return hook

    for i, g in enumerate(groups):
        for p in g:
            p.register_post_accumulate_grad_hook(hook_for(i))
    x = torch.randn(4096, 512)
    model(x).square().mean().backward()
    backward_done = time.perf_counter()
    for i in range(len(groups)):
        staging.to_host(i)
    first = min(device.copies, key=lambda c: c["queued"])
    assert first["queued"] < backward_done and first["started"] < backward_done
    assert {c["thread"] for c in device.copies} != {threading.current_thread().name}
    want = torch.cat([p.grad.reshape(-1) for p in groups[0]])
    assert torch.equal(hosts[0], want)
    # and back: the averaged host gradients land in .grad
    hosts[0].mul_(0.5)
    staging.to_device(0)
    assert torch.equal(torch.cat([p.grad.reshape(-1) for p in groups[0]]), want * 0.5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch.cuda.is_available() is False")
def test_cuda_staging_round_trip():
    from sparktrain.task.staging import CudaStaging

    model = nn.Linear(64, 8).cuda()
    model(torch.randn(16, 64, device="cuda")).sum().backward()
    params = list(model.parameters())
    device = staging_device(params)
    assert isinstance(device, CudaStaging)
    host = device.pinned(sum(p.numel() for p in params), torch.float32)
    assert host.is_pinned()
    staging = DeviceStaging(device, [(params, host, "fp16")])
    staging.to_host(0)
    want = torch.cat([p.grad.reshape(-1) for p in params]).half().float().cpu()
    assert torch.equal(host, want)
    host.mul_(2)
    staging.to_device(0)
    torch.cuda.synchronize()
    assert torch.equal(torch.cat([p.grad.reshape(-1) for p in params]).cpu(), want * 2)
