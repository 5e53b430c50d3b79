"""The parameter server's messages: fixed struct headers plus raw array payloads.

Every exchange is a request from a worker and one reply from a shard, on an
authenticated :class:`~sparktrain.comm.wire.Connection` (handshake with the job secret,
job id and stage attempt; the worker dials with ``peer_rank=DRIVER_RANK``). Headers are
small struct-packed ``send_bytes`` frames of their own kind; arrays travel as
``KIND_DATA`` frames (``send_array``/``recv_into``). Never pickle.

======  =====================================================  ==========================
kind    header                                                  followed by
======  =====================================================  ==========================
PUSH    job tag, attempt, rank, step, count, version, payload   the gradient (if payload)
ACK     status, lost rank, shard version                        a text frame if not OK
PULL    attempt, rank, step, version the worker holds          -
REPLY   status, lost rank, version, encoding, elements          the delta or values;
                                                                a text frame if not OK
BYE     attempt, rank, clean                                    -
======  =====================================================  ==========================

``step`` counts a rank's steps from 0 over the whole run. ``count`` is the number of
samples behind the gradient; a push with count 0 carries no payload. A push is
identified by (job, attempt, rank, step): the job and the attempt are proven by the
handshake and repeated in the header, so a push from an older stage attempt is
rejected even on a connection that somehow survived; a duplicate step is acknowledged
and not applied again.

Pulls are delta-encoded. The shard keeps, per rank, an exact mirror of the copy that
rank holds. A pull whose version equals the shard's costs one header (``UNCHANGED``);
otherwise the shard sends ``delta = params - mirror`` and adds the same delta to the
mirror, so both ends do the same float operations and stay bit-identical (the worker
is at most one rounding away from the server's parameters, never drifting). Without a
compressor a delta is as large as the values: the point is the seam — deltas (and
gradients) are what the compression issue quantises or sparsifies, in :class:`Codec`.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Protocol

import numpy as np

from sparktrain.comm.wire import KIND_USER_MIN
from sparktrain.errors import ConfigError

KIND_PUSH = KIND_USER_MIN
KIND_ACK = KIND_USER_MIN + 1
KIND_PULL = KIND_USER_MIN + 2
KIND_REPLY = KIND_USER_MIN + 3
KIND_BYE = KIND_USER_MIN + 4
KIND_TEXT = KIND_USER_MIN + 5

PUSH = struct.Struct("<QqqqqqB")  # job tag, attempt, rank, step, count, version, has payload
ACK = struct.Struct("<Biq")  # status, lost rank, version
PULL = struct.Struct("<qqqq")  # attempt, rank, step (-1: before the first), version held
REPLY = struct.Struct("<BiqBq")  # status, lost rank, version, encoding, elements
BYE = struct.Struct("<qqB")  # attempt, rank, clean (1: finished, 0: failed)

MAX_HEADER_BYTES = 64
MAX_TEXT_BYTES = 4096

# statuses
OK = 0
DUPLICATE = 1
"""The push was seen before: acknowledged, not applied again."""
STALE_ATTEMPT = 2
"""The push or pull comes from an earlier stage attempt: rejected."""
WRONG_JOB = 3
LOST = 4
"""A rank was lost (or missed the timeout): the run cannot go on; names the rank."""
PROTOCOL = 5
"""An out-of-order or malformed request."""
STOPPED = 6
"""The server is shutting down."""

STATUS_NAMES = {
    OK: "ok",
    DUPLICATE: "duplicate",
    STALE_ATTEMPT: "stale attempt",
    WRONG_JOB: "wrong job",
    LOST: "lost rank",
    PROTOCOL: "protocol error",
    STOPPED: "stopped",
}

# pull encodings
UNCHANGED = 0
"""Header only: the worker holds the shard's current version."""
DELTA = 1
"""The payload is ``params - mirror``; the worker adds it to its copy."""
FULL = 2
"""The payload is the values (first pull, or a worker that lost track)."""

NO_RANK = -2  # "lost rank" field when no rank is to blame


def job_tag(job_id: str) -> int:
    """A 64-bit tag of the job id carried in every push."""
    return int.from_bytes(hashlib.sha256(job_id.encode("utf-8")).digest()[:8], "little")


class Codec(Protocol):
    """How a gradient or a pull delta becomes a payload and back.

    The compression issue plugs its compressors in here (with error feedback kept per
    rank and shard); today only :class:`IdentityCodec` exists.
    """

    name: str

    def encode(self, values: np.ndarray) -> np.ndarray:
        """The payload to send for ``values`` (may be ``values`` itself)."""

    def decode_into(self, payload: np.ndarray, out: np.ndarray) -> None:
        """Write the values of ``payload`` into ``out``."""


class IdentityCodec:
    """No compression: the payload is the array."""

    name = "none"

    def encode(self, values: np.ndarray) -> np.ndarray:
        return values

    def decode_into(self, payload: np.ndarray, out: np.ndarray) -> None:
        if payload is not out:
            out[...] = payload


def make_codec(spec: str) -> Codec:
    """The codec for ``config.compression``."""
    if spec == "none":
        return IdentityCodec()
    raise ConfigError(f"compression={spec!r} is not supported by strategy='ps' yet")
