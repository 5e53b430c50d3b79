"""Executor-side communication: the authenticated wire, the mesh and allreduce algorithms.

Never imports pyspark: usable (and tested) with plain threads or processes.
"""

from sparktrain.comm.allreduce import ALLREDUCE_ALGOS, Allreduce, make_allreduce
from sparktrain.comm.connection import Connection
from sparktrain.comm.frames import (
    KIND_ABORT,
    KIND_CONTROL,
    KIND_DATA,
    KIND_METRICS,
    KIND_USER_MIN,
    MAX_FRAME_BYTES_DEFAULT,
)
from sparktrain.comm.handshake import DRIVER_RANK, accept, connect
from sparktrain.comm.link import LinkProfile, link_from_config, link_profile
from sparktrain.comm.listen import address_of, open_listener, parse_address
from sparktrain.comm.mesh import AsyncSender, Mesh
from sparktrain.comm.ring import RingAllreduce
from sparktrain.comm.stats import CommStats
from sparktrain.comm.tree import TreeAllreduce

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
