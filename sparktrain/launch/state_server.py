"""The driver's side of rank 0's state return (protocol: :mod:`sparktrain.worker.state`).

The trained state does not travel as a Spark task result: that is capped by
``spark.driver.maxResultSize`` (1 GiB by default) and would be held whole on the driver,
then copied into the model. :class:`StateReceiver` instead receives rank 0's tensors
piece by piece straight into the driver's own model (its state dict's tensors share the
parameters' memory): the driver's peak is the model itself plus one socket buffer.

The layout must match the driver's model exactly (names, dtypes, shapes), which it does
when ``model_fn`` is deterministic; anything else is refused before a byte is written.
The receiver serves one attempt; the trainer starts one per attempt. Writing into the
model is safe for every strategy that uses it: ring/tree workers build their own
models, and the parameter server copies the model's values when it starts.
"""

from __future__ import annotations

import json
import logging
import threading

import torch
from torch import nn

from sparktrain.comm.chunked import recv_chunked_into
from sparktrain.comm.connection import Connection
from sparktrain.comm.frames import KIND_CONTROL
from sparktrain.comm.security import WireSecurity
from sparktrain.comm.service import DriverService
from sparktrain.errors import CommError
from sparktrain.worker.state import LAYOUT_MAX_BYTES, byte_view, tensor_layout

log = logging.getLogger(__name__)


class StateReceiver(DriverService):
    """Receives rank 0's trained state into ``model``; :attr:`done` is set once it is
    all in place."""

    name = "state"

    def __init__(
        self,
        host: str,
        model: nn.Module,
        *,
        secret: bytes,
        job_id: str,
        attempt: int,
        security: WireSecurity | None = None,
    ) -> None:
        super().__init__(host, secret=secret, job_id=job_id, attempt=attempt, security=security)
        self._targets = model.state_dict(keep_vars=False)
        self._expected = tensor_layout(self._targets)
        self._lock = threading.Lock()  # one sender at a time (a straggler cannot interleave)
        self.done = threading.Event()
        self.received_bytes = 0
        self.error: str | None = None
        self.start()

    def handle(self, conn: Connection) -> None:
        with conn, self._lock:
            try:
                self._receive(conn)
            except (CommError, OSError, ValueError, KeyError, TypeError) as exc:
                self.error = f"{type(exc).__name__}: {exc}"
                log.warning("state receiver: rank 0's state did not arrive whole: %s", exc)

    def _receive(self, conn: Connection) -> None:
        _, raw = conn.recv_bytes(KIND_CONTROL, max_bytes=LAYOUT_MAX_BYTES)
        head = json.loads(raw)
        layout, step = head["layout"], int(head["chunk_bytes"])
        problem = self._mismatch(layout)
        if conn.peer_rank != 0:  # authenticated, but only rank 0 returns the state
            problem = f"rank {conn.peer_rank} sent a state; only rank 0 returns it"
        if problem is None and not 0 < step <= conn.max_frame_bytes:
            problem = f"chunk_bytes {step} outside (0, {conn.max_frame_bytes}]"
        if problem is None and self.done.is_set():
            problem = "this attempt's state was already received"
        if problem is not None:
            conn.send_bytes(json.dumps({"error": problem}).encode(), KIND_CONTROL)
            self.error = problem
            return
        conn.send_bytes(b"{}", KIND_CONTROL)
        got = 0
        with torch.no_grad():
            for tensor in self._targets.values():
                if tensor.is_contiguous():
                    recv_chunked_into(conn, byte_view(tensor), step)
                else:  # rare: receive this tensor alone, then copy it in place
                    tmp = torch.empty_like(tensor, memory_format=torch.contiguous_format)
                    recv_chunked_into(conn, byte_view(tmp), step)
                    tensor.copy_(tmp)
                got += tensor.numel() * tensor.element_size()
        self.received_bytes = got
        self.error = None
        self.done.set()
        conn.send_bytes(b"{}", KIND_CONTROL)

    def _mismatch(self, layout: list[dict[str, object]]) -> str | None:
        """Why ``layout`` does not fit the driver's model, or None."""
        if layout == self._expected:
            return None
        mine = {item["name"]: item for item in self._expected}
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
