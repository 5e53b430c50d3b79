"""The wire: the authenticated transport every sparktrain socket speaks, and what is built
on it for the executors.

Frames (:mod:`.frames`) after a mutual handshake (:mod:`.handshake`) behind a pre-auth
gate (:mod:`.preauth`), on a :class:`~sparktrain.wire.connection.Connection` with MACs or
TLS (:mod:`.security`), link emulation (:mod:`.link`) and byte counters (:mod:`.stats`);
transfers of any size (:mod:`.chunked`); listeners (:mod:`.listen`); a rank's
:class:`~sparktrain.wire.mesh.Mesh` and the allreduce algorithms on it (:mod:`.ring`,
:mod:`.tree`, chosen by name in :mod:`.collectives`); and the one base of the driver's
services (:mod:`.service`).

Never imports pyspark: usable (and tested) with plain threads or processes.
"""

from sparktrain.wire.collectives import ALLREDUCE_ALGOS, Allreduce, make_allreduce
from sparktrain.wire.connection import Connection
from sparktrain.wire.frames import (
    KIND_ABORT,
    KIND_CONTROL,
    KIND_DATA,
    KIND_METRICS,
    KIND_USER_MIN,
    MAX_FRAME_BYTES_DEFAULT,
)
from sparktrain.wire.handshake import DRIVER_RANK, accept, connect
from sparktrain.wire.link import LinkProfile, link_from_config, link_profile
from sparktrain.wire.listen import address_of, open_listener, parse_address
from sparktrain.wire.mesh import AsyncSender, Mesh
from sparktrain.wire.ring import RingAllreduce
from sparktrain.wire.stats import CommStats
from sparktrain.wire.tree import TreeAllreduce

__all__ = [
    "ALLREDUCE_ALGOS",
    "DRIVER_RANK",
    "KIND_ABORT",
    "KIND_CONTROL",
    "KIND_DATA",
    "KIND_METRICS",
    "KIND_USER_MIN",
    "MAX_FRAME_BYTES_DEFAULT",
    "Allreduce",
    "AsyncSender",
    "CommStats",
    "Connection",
    "LinkProfile",
    "Mesh",
    "RingAllreduce",
    "TreeAllreduce",
    "accept",
    "address_of",
    "connect",
    "link_from_config",
    "link_profile",
    "make_allreduce",
    "open_listener",
    "parse_address",
]
