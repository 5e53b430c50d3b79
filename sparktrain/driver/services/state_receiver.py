"""The driver's side of the state return (protocol: :mod:`sparktrain.task.state_sender`).

The trained state does not travel as a Spark task result: that is capped by
``spark.driver.maxResultSize`` (1 GiB by default) and would be held whole on the driver,
then copied into the model. :class:`StateReceiver` instead receives the ranks' tensors
piece by piece straight into the driver's own model (its state dict's tensors share the
parameters' memory): the driver's peak is the model itself plus one socket buffer.

Who sends what: by default rank 0 sends every key of the model (data parallel). Under
pipeline parallelism each stage's replica 0 sends its stage's keys (``senders``, e.g.
:func:`sparktrain.parallel.stage.state_senders`); the stages stream at the same time,
each into its own tensors, and :attr:`StateReceiver.done` is set once every sender's
part is in place.

Each layout must match its part of the driver's model exactly (names, dtypes, shapes,
order), which it does when ``model_fn`` is deterministic; anything else (and a rank
that sends no state, or sends twice) is refused before a byte is written. The receiver
serves one attempt; the trainer starts one per attempt. Writing into the model is safe
for every strategy that uses it: ring/tree workers build their own models, and the
parameter server copies the model's values when it starts.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Collection, Mapping
from typing import Any

import torch
from torch import nn

from sparktrain.errors import CommError, ConfigError
from sparktrain.task.state_sender import LAYOUT_MAX_BYTES, byte_view, tensor_layout
from sparktrain.wire.chunked import recv_chunked_into
from sparktrain.wire.connection import Connection
from sparktrain.wire.frames import KIND_CONTROL
from sparktrain.wire.security import WireSecurity
from sparktrain.wire.service import DriverService

log = logging.getLogger(__name__)


class StateReceiver(DriverService):
    """Receives the trained state into ``model``: every key from rank 0 (``senders``
    None), or from each rank of ``senders`` the keys it maps to, which must split the
    model's state dict into disjoint parts that together cover it. :attr:`done` is set
    once every part is in place.

    With ``model=None`` rank 0's tensors are taken as they come (``sparktrain.run``'s
    return value, whose layout only rank 0 knows): new tensors in the sent layout, in
    :attr:`received`."""

    name = "state"

    def __init__(
        self,
        host: str,
        model: nn.Module | None,
        *,
        secret: bytes,
        job_id: str,
        attempt: int,
        security: WireSecurity | None = None,
        senders: Mapping[int, Collection[str]] | None = None,
    ) -> None:
        self._free = model is None
        self.received: dict[str, torch.Tensor] = {}
        targets = model.state_dict(keep_vars=False) if model is not None else {}
        if senders is None:
            senders = {0: list(targets)}
        self._parts = _split(targets, senders)
        super().__init__(host, secret=secret, job_id=job_id, attempt=attempt, security=security)
        # one connection per sender at a time (a straggler cannot interleave); the parts
        # are disjoint, so different senders write at the same time
        self._locks = {rank: threading.Lock() for rank in self._parts}
        self._arrived: dict[int, int] = {}  # sender -> bytes, once its part is in place
        self._state_lock = threading.Lock()
        self.done = threading.Event()
        self.received_bytes = 0
        self.error: str | None = None
        self.start()

    def handle(self, conn: Connection) -> None:
        rank = conn.peer_rank
        # a rank that sends no state is refused on a lock of its own: it delays nobody
        with conn, self._locks.get(rank) or threading.Lock():
            try:
                self._receive(conn)
            except (CommError, OSError, ValueError, KeyError, TypeError) as exc:
                self.error = f"{type(exc).__name__}: {exc}"
                log.warning("state receiver: rank %d's state did not arrive whole: %s", rank, exc)

    def _receive(self, conn: Connection) -> None:
        _, raw = conn.recv_bytes(KIND_CONTROL, max_bytes=LAYOUT_MAX_BYTES)
        head = json.loads(raw)
        layout, step = head["layout"], int(head["chunk_bytes"])
        rank = conn.peer_rank  # authenticated in the handshake
        part = self._parts.get(rank)
        if part is None:
            ranks = ", ".join(map(str, sorted(self._parts)))
            verb = "returns it" if len(self._parts) == 1 else "return it"
            problem: str | None = f"rank {rank} sent a state; only rank {ranks} {verb}"
        elif self._free:
            part, problem = _allocate(layout)
        else:
            problem = _mismatch(part, layout)
        if problem is None and not 0 < step <= conn.max_frame_bytes:
            problem = f"chunk_bytes {step} outside (0, {conn.max_frame_bytes}]"
        if problem is None and rank in self._arrived:
            problem = (
                "this attempt's state was already received"
                if len(self._parts) == 1
                else f"this attempt's state from rank {rank} was already received"
            )
        if problem is not None:
            conn.send_bytes(json.dumps({"error": problem}).encode(), KIND_CONTROL)
            self.error = problem
            return
        assert part is not None
        conn.send_bytes(b"{}", KIND_CONTROL)
        got = 0
        with torch.no_grad():
            for tensor in part.values():
                if tensor.is_contiguous():
                    recv_chunked_into(conn, byte_view(tensor), step)
                else:  # rare: receive this tensor alone, then copy it in place
                    tmp = torch.empty_like(tensor, memory_format=torch.contiguous_format)
                    recv_chunked_into(conn, byte_view(tmp), step)
                    tensor.copy_(tmp)
                got += tensor.numel() * tensor.element_size()
        with self._state_lock:
            if self._free:
                self.received = part
            self._arrived[rank] = got
            self.received_bytes = sum(self._arrived.values())
            if len(self._arrived) == len(self._parts):
                self.error = None
                self.done.set()
        conn.send_bytes(b"{}", KIND_CONTROL)

    @property
    def pending(self) -> list[int]:
        """The senders whose part has not arrived yet."""
        with self._state_lock:
            return sorted(set(self._parts) - set(self._arrived))


def _allocate(layout: list[dict[str, Any]]) -> tuple[dict[str, torch.Tensor], str | None]:
    """Empty tensors for a sent layout, or why the layout is not one."""
    part: dict[str, torch.Tensor] = {}
    try:
        for item in layout:
            dtype = getattr(torch, str(item["dtype"]), None)
            if not isinstance(dtype, torch.dtype):
                return {}, f"tensor {item['name']!r}: unknown dtype {item['dtype']!r}"
            shape = [int(n) for n in item["shape"]]
            tensor = torch.empty(shape, dtype=dtype)
            if tensor.numel() * tensor.element_size() != int(item["nbytes"]):
                return {}, f"tensor {item['name']!r}: {item['nbytes']} bytes for shape {shape}"
            part[str(item["name"])] = tensor
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        return {}, f"malformed layout: {exc}"
    return part, None


def _split(
    targets: Mapping[str, torch.Tensor], senders: Mapping[int, Collection[str]]
) -> dict[int, dict[str, torch.Tensor]]:
    """Each sender's part of ``targets``, in the state dict's order; refuses keys the
    model lacks, keys of two senders, and keys of nobody."""
    owner: dict[str, int] = {}
    for rank, keys in senders.items():
        for key in keys:
            if key not in targets:
                raise ConfigError(f"state sender {rank}: the model has no tensor {key!r}")
            if key in owner:
                raise ConfigError(f"tensor {key!r} has two state senders: {owner[key]}, {rank}")
            owner[key] = rank
    unsent = [key for key in targets if key not in owner]
    if unsent:
        raise ConfigError(f"no state sender for the model's tensors {unsent[:3]}")
    parts: dict[int, dict[str, torch.Tensor]] = {rank: {} for rank in senders}
    for key, tensor in targets.items():
        parts[owner[key]][key] = tensor
    return parts


def _mismatch(part: Mapping[str, torch.Tensor], layout: list[dict[str, object]]) -> str | None:
    """Why ``layout`` does not fit ``part`` of the driver's model, or None."""
    expected = tensor_layout(part)
    if layout == expected:
        return None
    mine = {item["name"]: item for item in expected}
    theirs = {str(item["name"]): item for item in layout}
    if set(mine) != set(theirs):
        missing = sorted(set(mine) - set(theirs))[:3]
        extra = sorted(set(theirs) - set(mine))[:3]
        return (
            f"the workers' model has other tensors than the driver's (missing {missing}, "
            f"unexpected {extra}): model_fn must build the same model everywhere"
        )
    for name, item in mine.items():
        if theirs[name] != item:
            return (
                f"tensor {name!r}: the workers sent {theirs[name]}, the driver's model has "
                f"{item}: model_fn must build the same model everywhere"
            )
    return "the tensors come in another order than the driver's state dict"
