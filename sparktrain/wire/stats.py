"""Byte and frame counters of one rank's communication (:class:`CommStats`).

Every byte that crosses a sparktrain socket is counted here: handshakes, frame headers
(and their MAC tags) and payloads, per direction, plus the raw payload bytes a collective
asked to send (before framing), so compression and framing overhead can be told apart.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class CommStats:
    """Byte and frame counters of one rank's communication.

    Thread-safe: the counters are updated under a lock because a sender thread and
    the main thread both write them. Picklable (the lock is recreated).
    """

    raw_bytes_sent: int = 0
    """Payload bytes the aggregation asked to send in ``KIND_DATA`` frames (before framing)."""
    wire_bytes_sent: int = 0
    """Every byte written to sockets: handshakes, frame headers, payloads."""
    wire_bytes_recv: int = 0
    """Every byte read from sockets."""
    frames_sent: int = 0
    frames_recv: int = 0
    _lock: threading.Lock = field(
        default_factory=threading.Lock, init=False, repr=False, compare=False
    )

    def add_sent(self, wire: int, raw: int = 0, frames: int = 0) -> None:
        """Count bytes written (and optionally raw payload bytes and frames)."""
        with self._lock:
            self.wire_bytes_sent += wire
            self.raw_bytes_sent += raw
            self.frames_sent += frames

    def add_recv(self, wire: int, frames: int = 0) -> None:
        """Count bytes read (and optionally frames)."""
        with self._lock:
            self.wire_bytes_recv += wire
            self.frames_recv += frames

    def as_dict(self) -> dict[str, int]:
        """A consistent snapshot of the counters."""
        with self._lock:
            return {
                "raw_bytes_sent": self.raw_bytes_sent,
                "wire_bytes_sent": self.wire_bytes_sent,
                "wire_bytes_recv": self.wire_bytes_recv,
                "frames_sent": self.frames_sent,
                "frames_recv": self.frames_recv,
            }

    def merge(self, other: CommStats) -> None:
        """Add ``other``'s counters to this object's, in place."""
        snap = other.as_dict()  # other's lock first, then ours: never both at once
        with self._lock:
            self.raw_bytes_sent += snap["raw_bytes_sent"]
            self.wire_bytes_sent += snap["wire_bytes_sent"]
            self.wire_bytes_recv += snap["wire_bytes_recv"]
            self.frames_sent += snap["frames_sent"]
            self.frames_recv += snap["frames_recv"]

    def __getstate__(self) -> dict[str, int]:
        return self.as_dict()

    def __setstate__(self, state: dict[str, int]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
