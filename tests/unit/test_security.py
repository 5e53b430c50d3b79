"""Intruders and malformed input: our own errors only, promptly, nothing deserialized,
no listener on a wildcard address."""

from __future__ import annotations

import functools
import os
import pickle
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparktrain.errors import CommError
from sparktrain.task import step_sync as sync_module
from sparktrain.task.context import WorkerContext
from sparktrain.task.run_task import run_partition
from sparktrain.wire.frames import KIND_METRICS
from sparktrain.wire.handshake import accept
from sparktrain.wire.listen import address_of, open_listener, parse_address
from sparktrain.wire.stats import CommStats

from . import fixtures
from .fixtures import loop_spec, random_parts, run_ranks

pytestmark = pytest.mark.timeout(120)


# ------------------------------------------------------------------ fuzzing the decoder
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(junk=st.binary(min_size=0, max_size=300), via=st.sampled_from(["bytes", "array"]))
def test_arbitrary_bytes_after_the_handshake_raise_only_our_errors(junk, via):
    # the connection's timeout outlasts the test's: the decoder must stop at the end of
    # the stream, never wait for the timeout
    client, server = fixtures.pair(600.0)
    try:
        client._sock.sendall(junk)
        client._sock.shutdown(socket.SHUT_WR)  # then end of stream: the decoder must stop
        try:
            if via == "bytes":
                server.recv_bytes(max_bytes=1 << 16)
            else:
                server.recv_into(np.empty(16, dtype=np.float32))
        except CommError as exc:  # FrameError, PeerLostError: ours
            assert "no progress" not in str(exc)
    finally:
        client.close()
        server.close()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(junk=st.binary(min_size=0, max_size=200))
def test_arbitrary_bytes_instead_of_a_handshake_are_refused(junk):
    listener = open_listener("127.0.0.1")
    try:
        with socket.create_connection(
            socket.getaddrinfo(*parse_address(address_of(listener)), socket.AF_INET)[0][4],
            timeout=2,
        ) as raw:
            raw.sendall(junk)
            raw.shutdown(socket.SHUT_WR)
            with pytest.raises(CommError):
                accept(
                    listener,
                    secret=fixtures.SECRET,
                    job_id=fixtures.JOB,
                    attempt=0,
                    my_rank=0,
                    timeout=1.0,
                    stats=CommStats(),
                )
    finally:
        listener.close()


class _Gadget:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (open, (self.marker, "w"))


def test_a_pickle_gadget_on_the_wire_stays_bytes(tmp_path):
    marker = tmp_path / "pwned"
    gadget = pickle.dumps(_Gadget(str(marker)))
    client, server = fixtures.pair(2.0)
    try:
        client.send_bytes(gadget, KIND_METRICS)
        kind, payload = server.recv_bytes()
        assert payload == gadget and kind == KIND_METRICS
        client._sock.sendall(gadget)  # and as a raw stream where a header should be
        with pytest.raises(CommError):
            server.recv_bytes()
    finally:
        client.close()
        server.close()
    assert not marker.exists()


# ------------------------------------------------------------------ no wildcard listeners
def _listening_sockets() -> list[tuple[str, int]]:
    """(address, port) of this process's listening TCP sockets, from /proc/net/tcp{,6}."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            local, state, inode = cols[1], cols[3], cols[9]
            if state != "0A" or inode not in inodes:  # 0A = LISTEN
                continue
            addr_hex, port_hex = local.split(":")
            raw = bytes.fromhex(addr_hex)
            if width == 8:
                addr = socket.inet_ntop(socket.AF_INET, raw[::-1])
            else:
                addr = socket.inet_ntop(
                    socket.AF_INET6, b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
                )
            found.append((addr, int(port_hex, 16)))
    return found


def test_no_listener_binds_a_wildcard_address_during_training(monkeypatch):
    seen: list[list[tuple[str, int]]] = []
    original = sync_module.AllreduceSync.reduce

    def spying_reduce(self, count, micro=1):  # type: ignore[no-untyped-def]
        if not seen:
            seen.append(_listening_sockets())
        return original(self, count, micro)

    monkeypatch.setattr(sync_module.AllreduceSync, "reduce", spying_reduce)
    spec = loop_spec(epochs=1, batch_size=2)
    parts = random_parts([6, 6])

    def rank_fn(rank, coll):  # type: ignore[no-untyped-def]
        ctx = WorkerContext(
            rank, 2, "127.0.0.1", functools.partial(coll.all_gather, rank), coll.barrier, spec
        )
        return run_partition(ctx, parts[rank])

    run_ranks(2, rank_fn)
    listening = seen[0]
    assert len(listening) >= 2  # both ranks' listeners were open mid-training
    wildcards = [a for a in listening if a[0] in ("0.0.0.0", "::")]
    assert not wildcards, wildcards
    assert all(addr == "127.0.0.1" for addr, _ in listening)


# ------------------------------------------------------------------ fuzzing the decompressors
FUZZ_SPECS = ["fp16", "bf16", "int8", "topk:0.1", "randomk:0.1", "sign", "powersgd:1"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    spec=st.sampled_from(FUZZ_SPECS),
    junk=st.binary(min_size=0, max_size=400),
    numel=st.integers(min_value=0, max_value=64),
)
def test_arbitrary_bytes_through_every_decompressor_raise_only_our_errors(spec, junk, numel):
    """Random messages, and valid messages with a flipped byte, through decode + decompress.

    Every socket path passes the element count it expects (numel 0 stands for the valid
    message's own 16): without one, a flipped byte in the count makes a sparse
    decompressor allocate whatever it says. Only Spark's own channel (treeAggregate)
    decodes without a count."""
    from sparktrain.compress.base import BucketState, decode_message, encode_message
    from sparktrain.compress.registry import build

    comp = build(spec)
    assert comp is not None
    valid = encode_message(
        *comp.compress(torch.arange(16, dtype=torch.float32), BucketState(shapes=((4, 4),))),
        count=1.0,
    )
    flipped = valid.copy()
    if len(junk) and flipped.size:
        flipped[junk[0] % flipped.size] ^= 0xFF
    for blob in (junk, flipped.tobytes()):
        try:
            payload, ctx, _ = decode_message(blob, numel or 16)
            comp.decompress(payload, ctx)
        except CommError:
            pass  # FrameError: ours
