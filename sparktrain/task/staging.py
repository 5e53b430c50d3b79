"""Staging gradients between device memory and the host buffers the wire reads.

sparktrain's collectives send host memory (numpy views of the gradient buckets). When
the parameters live on a GPU, each bucket's gradients are flattened on the device,
optionally compressed there (a ``fp16``/``bf16`` bucket is cast before the copy: half
the bytes over PCIe, and the same numbers, since the host compressor's cast of an
already-cast value changes nothing), copied into a pinned host buffer on a side
stream, and after the allreduce copied back. :meth:`DeviceStaging.start` runs from the
gradient hook of a bucket that is complete, so the device→host copy of the last layers
overlaps the backward pass of the first ones; the communication thread waits for it in
:meth:`DeviceStaging.to_host`.

The device is a small interface (:class:`StagingDevice`): :class:`CudaStaging` on CUDA;
unit tests use a fake whose "device" tensors are CPU tensors and whose copies run on a
thread, to check the numbers and the overlap without a GPU. On CPU parameters there is
no staging at all (:func:`staging_device` returns ``None``): the buckets hold the
gradients themselves, as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

# bucket specs whose compression is a cast the device can do before the copy
DEVICE_CASTS = {"fp16": torch.float16, "bf16": torch.bfloat16}


class Pending(Protocol):
    """A copy in flight."""

    def wait(self) -> None:
        """Block until the copy's destination holds its data."""


class StagingDevice(Protocol):
    """What staging needs from a device."""

    def pinned(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer the device copies to and from asynchronously."""

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A buffer in device memory."""

    def to_host_async(self, dst: torch.Tensor, src: torch.Tensor) -> Pending:
        """Copy ``src`` (device) into ``dst`` (pinned host) after the work queued on the
        device so far, without blocking the caller."""

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy ``src`` (pinned host) into ``dst`` (device), ordered before any device
        work queued after it."""


class _Done:
    def wait(self) -> None:
        return None


class _CudaPending:
    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def wait(self) -> None:
        self.event.synchronize()


class CudaStaging:
    """:class:`StagingDevice` on one CUDA device: copies to the host on a side stream,
    each after an event recorded on the compute stream when it was queued."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def pinned(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, pin_memory=True)

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, device=self.device)

    def to_host_async(self, dst: torch.Tensor, src: torch.Tensor) -> Pending:
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        done = torch.cuda.Event()
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            dst.copy_(src, non_blocking=True)
            done.record(self.stream)
        return _CudaPending(done)

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        # on the compute stream: the optimizer step queued next sees the data
        with torch.cuda.device(self.device):
            dst.copy_(src, non_blocking=True)


def staging_device(params: Sequence[nn.Parameter]) -> StagingDevice | None:
    """The staging device for these parameters, or ``None`` on the CPU (no staging)."""
    if not params or params[0].device.type == "cpu":
        return None
    device = params[0].device
    if any(p.device != device for p in params):
        raise ValueError("the model's parameters span several devices; put it on one")
    if device.type == "cuda":
        return CudaStaging(device)
    raise ValueError(f"no gradient staging for parameters on {device}: use cpu or cuda")


@dataclass
class _Slot:
    params: list[nn.Parameter]
    host: torch.Tensor  # the bucket's gradient elements on the host (what the wire reads)
    device: torch.Tensor  # the flattened gradients in device memory
    cast: torch.Tensor | None  # device-side compressed copy (fp16/bf16 buckets)
    staged: torch.Tensor | None  # its pinned host twin
    pending: Pending | None = None


class DeviceStaging:
    """Per-bucket device↔host staging for :class:`~sparktrain.task.buckets.GradientBuckets`.

    ``buckets`` gives, per bucket in index order, its parameters, its host gradient
    buffer (pinned, from ``device.pinned``) and its compression spec.
    """

    def __init__(
        self,
        device: StagingDevice,
        buckets: Sequence[tuple[list[nn.Parameter], torch.Tensor, str]],
    ) -> None:
        self.device = device
        self.slots: list[_Slot] = []
        for params, host, spec in buckets:
            n = host.numel()
            cast = DEVICE_CASTS.get(spec)
            self.slots.append(
                _Slot(
                    params,
                    host,
                    device.empty(n, host.dtype),
                    device.empty(n, cast) if cast is not None else None,
                    device.pinned(n, cast) if cast is not None else None,
                )
            )
        self.bytes_to_host = 0
        self.bytes_to_device = 0

    def start(self, index: int) -> None:
        """Flatten bucket ``index``'s gradients on the device (compressing a cast
        bucket there) and start the copy to the host. From the gradient hook: the
        copy then overlaps the rest of the backward pass."""
        s = self.slots[index]
        if s.pending is not None:
            return
        with torch.no_grad():
            offset = 0
            for p in s.params:
                n = p.numel()
                if p.grad is None:
                    s.device[offset : offset + n].zero_()
                else:
                    s.device[offset : offset + n].copy_(p.grad.reshape(-1))
                offset += n
            src, dst = s.device, s.host
            if s.cast is not None and s.staged is not None:
                s.cast.copy_(s.device)
                src, dst = s.cast, s.staged
        s.pending = self.device.to_host_async(dst, src)
        self.bytes_to_host += src.numel() * src.element_size()

    def to_host(self, index: int) -> None:
        """Bucket ``index``'s gradients in its host buffer (starting the copy if no
        hook did), for the allreduce."""
        self.start(index)
        s = self.slots[index]
        assert s.pending is not None
        s.pending.wait()
        s.pending = None
        if s.staged is not None:  # the host side of a device-side cast
            s.host.copy_(s.staged)

    def to_device(self, index: int) -> None:
        """Bucket ``index``'s averaged host gradients back into the parameters' ``.grad``."""
        s = self.slots[index]
        self.device.to_device(s.device, s.host)
        self.bytes_to_device += s.host.numel() * s.host.element_size()
        with torch.no_grad():
            offset = 0
            for p in s.params:
                n = p.numel()
                view = s.device[offset : offset + n].view_as(p)
                if p.grad is None:
                    p.grad = view.clone()
                else:
                    p.grad.copy_(view)
                offset += n

    def stats(self) -> dict[str, int]:
        """Bytes copied each way, for the summary."""
        return {
            "staged_to_host_bytes": self.bytes_to_host,
            "staged_to_device_bytes": self.bytes_to_device,
        }
