"""The short frame header and the compact message header (issue 34.3): both forms round
trip, where the short form stops applying, and every malformed input is our error."""

from __future__ import annotations

import socket
import struct
import threading
import tracemalloc
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparktrain.compress.base import (
    MAX_META,
    BucketState,
    Ctx,
    compact_form,
    decode_message,
    encode_message,
    message_nbytes,
)
from sparktrain.compress.registry import build
from sparktrain.errors import CommError, ConfigError, FrameError, PeerLostError
from sparktrain.wire.connection import Connection
from sparktrain.wire.frames import (
    CODE_DTYPES,
    DTYPE_CODES,
    FLAG_STAMPED,
    FRAME_HEADER,
    HEADER_BYTES,
    KIND_ABORT,
    KIND_CONTROL,
    KIND_DATA,
    KIND_PAYLOAD,
    MAX_NDIM,
    PREFIX_BYTES,
    SHORT_HEADER,
    SHORT_HEADER_BYTES,
    SHORT_MAGIC,
    SHORT_MAX,
    header_bytes,
    header_size,
    pack_header,
    short_form,
    unpack_header,
)
from sparktrain.wire.security import TAG_BYTES, WireSecurity

from . import fixtures

pytestmark = pytest.mark.timeout(60)

F32 = DTYPE_CODES[np.dtype(np.float32)]
U8 = DTYPE_CODES[np.dtype(np.uint8)]
LONG = 600.0
"""A comm timeout that outlasts the test's own: an error that comes at all did not wait
for it."""


def _pair(mac: bool = False, timeout: float = 2.0) -> tuple[Connection, Connection]:
    security = WireSecurity(frame_mac=True) if mac else None
    client, server = fixtures.pair(
        timeout, client_kw={"security": security}, server_kw={"security": security}
    )
    assert isinstance(client, Connection), client
    assert isinstance(server, Connection), server
    return client, server


def _short(
    kind: int = KIND_DATA,
    code: int = F32,
    length: int = 16,
    seq: int = 0,
    ndim: int = 1,
    flags: int = 0,
    magic: bytes = SHORT_MAGIC,
) -> bytes:
    return SHORT_HEADER.pack(magic, kind, code, ndim, flags, seq, length)


# ------------------------------------------------------------------ frame headers, pure


@settings(max_examples=200, deadline=None)
@given(
    kind=st.integers(0, 255),
    code=st.sampled_from(sorted(CODE_DTYPES)),
    shape=st.one_of(
        st.lists(st.integers(0, 64), min_size=0, max_size=MAX_NDIM),
        st.tuples(st.integers(0, 1 << 34)).map(list),  # 1-D, past the short form's lengths
    ),
    seq=st.one_of(st.integers(0, 1 << 33), st.just(SHORT_MAX - 1), st.just(SHORT_MAX)),
    stamp=st.one_of(st.just(0), st.integers(1, (1 << 63) - 1)),
)
def test_headers_round_trip_in_the_form_that_applies(
    kind: int, code: int, shape: list[int], seq: int, stamp: int
) -> None:
    nbytes = int(np.prod(shape, dtype=np.int64)) * CODE_DTYPES[code].itemsize
    buf = bytearray(HEADER_BYTES)
    size = pack_header(buf, kind, code, shape, nbytes, seq, stamp)
    short = short_form(code, shape, nbytes, seq)
    assert size == header_bytes(code, shape, nbytes, seq, stamped=stamp > 0)
    assert size == (SHORT_HEADER_BYTES + 8 * (stamp > 0) if short else HEADER_BYTES)
    assert header_size(buf[:PREFIX_BYTES]) == size
    if short and kind == KIND_ABORT:  # a receiver refuses it; senders never make one
        with pytest.raises(FrameError, match="abort notice in the short form"):
            unpack_header(buf)
        return
    head = unpack_header(buf[:size])
    assert (head.size, head.kind, head.code, head.seq, head.length) == (
        size,
        kind,
        code,
        seq,
        nbytes,
    )
    assert head.stamp == stamp and bool(head.flags & FLAG_STAMPED) == (stamp > 0)
    if stamp and len(shape) == MAX_NDIM:  # the stamp's slot: the last two dims merged
        assert head.shape == (*shape[:-2], shape[-2] * shape[-1])
    else:
        assert head.shape == tuple(shape)


def test_where_the_short_form_stops() -> None:
    """1-D, a known dtype whose elements make up the length, 32-bit seq and length."""
    assert short_form(F32, (4,), 16, 0)
    assert short_form(F32, (0,), 0, 0)
    assert short_form(U8, (SHORT_MAX - 1,), SHORT_MAX - 1, SHORT_MAX - 1)
    assert not short_form(U8, (SHORT_MAX,), SHORT_MAX, 0)  # length
    assert not short_form(F32, (4,), 16, SHORT_MAX)  # sequence number
    assert not short_form(F32, (2, 2), 16, 0)  # 2-D
    assert not short_form(F32, (), 4, 0)  # 0-D
    assert not short_form(0, (9,), 0, 0)  # an abort notice: no dtype, a rank in the shape
    assert not short_form(F32, (5,), 16, 0)  # a shape that is not the length
    assert header_bytes(F32, (4,), 16, SHORT_MAX - 1, stamped=False) == SHORT_HEADER_BYTES
    assert header_bytes(F32, (4,), 16, SHORT_MAX, stamped=False) == HEADER_BYTES
    assert header_bytes(F32, (4,), 16, 0, stamped=True) == SHORT_HEADER_BYTES + 8
    assert PREFIX_BYTES == SHORT_HEADER_BYTES == 16 and HEADER_BYTES == 88


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (b"HTTP" + bytes(12), "bad magic"),
        (b"STF2" + bytes(12), "bad magic"),
        (_short()[:10], "cut short"),
        (_short(flags=FLAG_STAMPED), "cut short"),  # the stamp is missing
        (FRAME_HEADER.pack(b"STF1", 1, F32, 1, 0, 0, 4, 1, *[0] * 7)[:40], "cut short"),
        (_short(ndim=2), "ndim 2"),
        (_short(ndim=0), "ndim 0"),
        (_short(kind=KIND_ABORT, length=0), "abort notice in the short form"),
        (_short(code=0), "unknown dtype code 0"),
        (_short(code=200), "unknown dtype code 200"),
        (_short(length=15), "whole number"),
        (FRAME_HEADER.pack(b"STF1", 1, F32, 9, 0, 0, 4, *[0] * 8), "ndim 9"),
        (FRAME_HEADER.pack(b"STF1", 1, F32, 8, FLAG_STAMPED, 0, 4, *[1] * 8), "every slot"),
    ],
)
def test_malformed_headers_are_frame_errors(raw: bytes, match: str) -> None:
    with pytest.raises(FrameError, match=match):
        unpack_header(raw)


@settings(max_examples=300, deadline=None)
@given(junk=st.binary(min_size=0, max_size=HEADER_BYTES), magic=st.sampled_from(["short", "long"]))
def test_arbitrary_header_bytes_decode_or_raise_our_error(junk: bytes, magic: str) -> None:
    raw = (SHORT_MAGIC if magic == "short" else b"STF1") + junk
    try:
        head = unpack_header(raw)
    except FrameError:
        return
    assert head.size <= len(raw) and head.size in (SHORT_HEADER_BYTES, 24, HEADER_BYTES)
    if head.size < HEADER_BYTES:
        dtype = CODE_DTYPES[head.code]
        assert head.shape == (head.length // dtype.itemsize,)
        assert head.length < SHORT_MAX and head.kind != KIND_ABORT


# ------------------------------------------------------------------ frames on a connection

MIXED: list[tuple[np.ndarray, int]] = [
    (np.arange(10, dtype=np.float32), KIND_DATA),  # short
    (np.arange(12, dtype=np.float64).reshape(3, 4), KIND_DATA),  # long, right after
    (np.zeros(0, dtype=np.float32), KIND_DATA),  # short, empty
    (np.arange(24, dtype=np.int16).reshape(2, 3, 4), KIND_PAYLOAD),  # long
    (np.array(2.5), KIND_DATA),  # long (0-D)
    (np.arange(3, dtype=np.uint8), KIND_PAYLOAD),  # short, 3 bytes
    (np.random.default_rng(0).standard_normal(200_000).astype(np.float32), KIND_DATA),
    (np.arange(200_000, dtype=np.float32).reshape(400, 500), KIND_DATA),  # long and large
]


@pytest.mark.parametrize("mac", [False, True], ids=["plain", "mac"])
@pytest.mark.parametrize("via", ["recv_into", "recv_bytes"])
def test_both_forms_back_to_back_on_a_connection(mac: bool, via: str) -> None:
    """Short and long frames interleaved, sent before any is read (so the receiver's
    first read of a frame may hold the next one's bytes): each arrives whole, and the
    wire counts each frame's own header."""
    client, server = _pair(mac)
    small, large = MIXED[:-2], MIXED[-2:]
    try:
        before = client.stats.wire_bytes_sent
        for arr, kind in small:  # these fit the socket buffers
            client.send_array(arr, kind)
        client.send_bytes(b"{}", KIND_CONTROL)
        for arr, kind in small:
            if via == "recv_into":
                flat = np.empty(arr.size, dtype=arr.dtype)  # 2-D frames into 1-D buffers
                server.recv_into(flat, kind)
                assert flat.tobytes() == arr.tobytes()
            else:
                assert server.recv_bytes(kind) == (kind, arr.tobytes())
        assert server.recv_bytes(KIND_CONTROL) == (KIND_CONTROL, b"{}")
        tag = TAG_BYTES if mac else 0
        want = sum(
            (SHORT_HEADER_BYTES if a.ndim == 1 else HEADER_BYTES) + a.nbytes for a, _ in small
        )
        want += SHORT_HEADER_BYTES + 2 + tag * (len(small) + 1)
        assert client.stats.wire_bytes_sent - before == want
        assert server.stats.wire_bytes_recv == client.stats.wire_bytes_sent
        # large frames of both forms, from a thread (they outgrow the socket buffers)
        errors: list[BaseException] = []
        for arr, kind in large:

            def send(a: np.ndarray = arr, k: int = kind) -> None:
                try:
                    client.send_array(a, k)
                except BaseException as exc:
                    errors.append(exc)

            t = threading.Thread(target=send, daemon=True)
            t.start()
            flat = np.empty(arr.size, dtype=arr.dtype)
            server.recv_into(flat, kind)
            t.join(10)
            assert not errors and flat.tobytes() == arr.tobytes()
    finally:
        client.close()
        server.close()


def _attack(frames: bytes, receive: Any, mac: bool = False) -> tuple[BaseException, int]:
    """Send raw ``frames`` after a valid handshake; return the receiver's error and its
    peak allocation."""
    security = WireSecurity(frame_mac=True) if mac else None
    client, server = fixtures.pair(
        LONG, client_kw={"security": security}, server_kw={"security": security}
    )
    assert isinstance(client, Connection) and isinstance(server, Connection)
    try:
        client._sock.sendall(frames)
        client._sock.shutdown(socket.SHUT_WR)  # then end of stream
        tracemalloc.start()
        try:
            with pytest.raises(CommError) as info:
                receive(server)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        return info.value, peak
    finally:
        client.close()
        server.close()


def _into(conn: Connection) -> None:
    conn.recv_into(np.empty(4, np.float32))


def _bytes(conn: Connection) -> None:
    conn.recv_bytes(KIND_DATA)


@pytest.mark.parametrize("receive", [_into, _bytes], ids=["recv_into", "recv_bytes"])
@pytest.mark.parametrize(
    ("frames", "error", "match"),
    [
        (_short(magic=b"STFx"), FrameError, "bad magic"),
        (_short(length=SHORT_MAX - 4) + bytes(16), FrameError, "cap"),  # oversized
        (_short(code=200), FrameError, "dtype code"),
        (_short(code=0), FrameError, "dtype code"),
        (_short(length=14) + bytes(14), FrameError, "whole number"),
        (_short(ndim=3) + bytes(16), FrameError, "ndim 3"),
        (_short(seq=1) + bytes(16), FrameError, "sequence number 1, expected 0"),
        (_short(kind=KIND_ABORT, length=0), FrameError, "abort notice in the short form"),
        (_short(kind=KIND_CONTROL) + bytes(16), FrameError, "kind 2, expected 1"),
        (_short()[:9], PeerLostError, "closed the connection"),  # truncated header
        (_short(flags=FLAG_STAMPED), PeerLostError, "closed the connection"),  # no stamp
        (_short() + bytes(7), PeerLostError, "closed the connection"),  # truncated payload
    ],
)
def test_malformed_short_frames_are_refused(
    frames: bytes, error: type[BaseException], match: str, receive: Any
) -> None:
    exc, peak = _attack(frames, receive)
    assert isinstance(exc, error) and match in str(exc), exc
    assert peak < 1 << 20  # nothing allocated for the announced length


def test_a_short_frame_without_its_tag_or_with_a_forged_one_is_refused() -> None:
    frame = _short() + bytes(TAG_BYTES) + bytes(16)
    exc, _ = _attack(frame, _into, mac=True)
    assert isinstance(exc, FrameError) and "MAC does not verify" in str(exc)
    exc, _ = _attack(_short() + bytes(5), _into, mac=True)
    assert isinstance(exc, PeerLostError)


@pytest.mark.parametrize(("offset", "xor"), [(0, 0x20), (4, KIND_DATA ^ KIND_PAYLOAD), (7, 1)])
def test_the_mac_covers_the_short_header(offset: int, xor: int) -> None:
    """Magic, kind and flags of a sealed short header: altering any is a MAC failure
    (or, for the magic, no frame at all)."""
    client, server = _pair(mac=True, timeout=LONG)
    try:
        arr = np.arange(4, dtype=np.float32)
        view = memoryview(arr).cast("B")
        for seq in range(2):
            sealed = bytearray(client._frame_header(KIND_DATA, F32, (4,), 16, seq, 0, view))
            assert len(sealed) == SHORT_HEADER_BYTES + TAG_BYTES
            if seq == 1:
                sealed[offset] ^= xor
            client._sock.sendall(bytes(sealed) + arr.tobytes())
        # a flipped stamp flag makes the header 8 bytes longer: the payload's bytes run
        # on into what follows, and the MAC over them fails
        client._sock.sendall(bytes(8))
        out = np.empty(4, np.float32)
        server.recv_into(out)  # the genuine one
        assert out.tolist() == arr.tolist()
        client._sock.shutdown(socket.SHUT_WR)
        with pytest.raises(CommError) as info:
            server.recv_into(out, KIND_PAYLOAD if offset == 4 else KIND_DATA)
        want = "bad magic" if offset == 0 else "MAC does not verify"
        assert isinstance(info.value, FrameError) and want in str(info.value)
    finally:
        client.close()
        server.close()


def test_the_abort_notice_keeps_the_long_form() -> None:
    client, server = _pair()
    try:
        before = client.stats.wire_bytes_sent
        assert client.notify_abort(5)
        assert client.stats.wire_bytes_sent - before == HEADER_BYTES
        with pytest.raises(PeerLostError, match="lost contact with rank 5"):
            server.recv_into(np.empty(64, np.float32))  # the notice is shorter than that
    finally:
        client.close()
        server.close()


# ------------------------------------------------------------------ compressed messages


def _parts(draw: Any) -> tuple[np.ndarray, ...]:
    dtypes = [np.uint8, np.int8, np.int16, np.uint16, np.int32, np.int64, np.float16]
    dtypes += [np.float32, np.float64]
    n = draw(st.integers(0, 4))
    out = []
    for _ in range(n):
        dt = draw(st.sampled_from(dtypes))
        size = draw(st.integers(0, 40))
        out.append(np.arange(size).astype(dt))
    return tuple(out)


@st.composite
def messages(draw: Any) -> tuple[tuple[np.ndarray, ...], Ctx, float]:
    parts = _parts(draw)
    meta = tuple(draw(st.lists(st.floats(allow_nan=False), max_size=4)))
    numel = draw(st.one_of(st.integers(0, 1000), st.just(SHORT_MAX - 1), st.just(SHORT_MAX)))
    count = float(draw(st.one_of(st.integers(0, 64), st.just(SHORT_MAX - 1), st.just(SHORT_MAX))))
    return parts, Ctx(numel, meta), count


@settings(max_examples=200, deadline=None)
@given(msg=messages())
def test_messages_round_trip_in_either_form(
    msg: tuple[tuple[np.ndarray, ...], Ctx, float],
) -> None:
    payload, ctx, count = msg
    blob = encode_message(payload, ctx, count)
    assert blob.size == message_nbytes(payload, ctx, count)
    compact = compact_form(payload, ctx, count)
    assert blob[:4].tobytes() == (b"STCs" if compact else b"STC1")
    for data in (blob, blob.tobytes()):
        parts, got_ctx, got_count = decode_message(data, ctx.numel)
        assert got_ctx == ctx and got_count == count
        assert len(parts) == len(payload)
        for p, q in zip(parts, payload, strict=True):
            assert p.dtype == q.dtype and p.tobytes() == q.tobytes()
        if data is blob:  # each part at a multiple of its itemsize of an aligned buffer
            assert all(p.flags.aligned for p in parts)


def test_where_the_compact_message_stops() -> None:
    vals = np.ones(3, np.float32)
    assert compact_form((vals,), Ctx(3), SHORT_MAX - 1)
    assert not compact_form((vals,), Ctx(3), SHORT_MAX)  # the sample count
    assert not compact_form((vals,), Ctx(3), 1.5)  # not a whole number (decoding refuses it)
    assert not compact_form((vals,), Ctx(3), float("nan"))
    assert compact_form((), Ctx(SHORT_MAX - 1))
    assert not compact_form((), Ctx(SHORT_MAX))  # the element count
    assert not compact_form((), Ctx(-1))
    assert compact_form((), Ctx(3, (0.0,) * 255))
    assert not compact_form((), Ctx(3, (0.0,) * 256))  # the ctx numbers
    long_blob = encode_message((), Ctx(3, (0.0,) * 256), 1.0)
    assert long_blob[:4].tobytes() == b"STC1"
    # (the long form's ctx count is 16-bit: PowerSGD's 3 a matrix no longer overflow it)
    assert decode_message(long_blob, 3)[1] == Ctx(3, (0.0,) * 256)
    assert decode_message(encode_message((), Ctx(3, (1.0,) * MAX_META)), 3)[1].meta[-1] == 1.0
    with pytest.raises(ConfigError, match="ctx numbers"):
        encode_message((), Ctx(3, (0.0,) * (MAX_META + 1)))


def test_a_top_k_segment_of_the_digits_mlp_at_world_8_costs_40_bytes_of_headers() -> None:
    """The case that asked for both forms: 13 values of a 1,202-element segment."""
    comp = build("topk:0.01")
    assert comp is not None
    x = torch.from_numpy(np.random.default_rng(0).standard_normal(1202).astype(np.float32))
    payload, ctx = comp.compress(x, BucketState())
    raw = sum(p.nbytes for p in payload)
    assert raw == 13 * (4 + 2)
    blob = encode_message(payload, ctx, 8.0)
    frame = header_bytes(U8, blob.shape, blob.nbytes, 0, stamped=False)
    assert blob.nbytes - raw + frame == 40  # 14 + 2 * 5 + 16; the long forms: 144 and 10 of padding
    parts, got, count = decode_message(blob, 1202)
    assert count == 8.0 and got == ctx
    assert torch.equal(comp.decompress(parts, got), comp.decompress(payload, ctx))


def _compact_blob() -> np.ndarray:
    payload = (np.arange(5, dtype=np.float32), np.arange(5, dtype=np.uint16))
    blob = encode_message(payload, Ctx(100, (2.5,)), 3.0)
    assert blob[:4].tobytes() == b"STCs"
    return blob


def test_every_truncation_of_a_compact_message_is_refused() -> None:
    blob = _compact_blob()
    for n in range(blob.size):
        with pytest.raises(FrameError):
            decode_message(blob[:n], 100)
    with pytest.raises(FrameError, match="do not match"):
        decode_message(np.concatenate([blob, np.zeros(1, np.uint8)]), 100)


@pytest.mark.parametrize(
    ("offset", "value", "match"),
    [
        (0, b"STCx", "bad magic"),
        (0, b"STC2", "bad magic"),
        (4, bytes([17]), "exceed the limits"),  # 17 parts
        (6, struct.pack("<I", 101), "describes 101 elements"),
        (14, bytes([99]), "dtype code 99"),
        (15, struct.pack("<I", 21), "dtype code 7 with 21 bytes"),  # not whole float32s
        (15, struct.pack("<I", SHORT_MAX - 4), "do not match"),  # oversized part
        (20, struct.pack("<I", 12), "do not match"),  # a part longer than the message
    ],
)
def test_malformed_compact_messages_are_refused(offset: int, value: bytes, match: str) -> None:
    blob = _compact_blob().copy()
    blob[offset : offset + len(value)] = np.frombuffer(value, np.uint8)
    with pytest.raises(FrameError, match=match):
        decode_message(blob, 100)


def test_a_compact_message_too_many_ctx_numbers_for_its_size_is_refused() -> None:
    blob = _compact_blob().copy()
    blob[5] = 200  # 200 ctx numbers: the table runs past the end
    with pytest.raises(FrameError, match="truncated part table"):
        decode_message(blob, 100)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    junk=st.binary(min_size=0, max_size=120),
    flips=st.lists(st.tuples(st.integers(0, 200), st.integers(1, 255)), max_size=3),
)
def test_fuzzed_compact_messages_decode_or_raise_our_error(
    junk: bytes, flips: list[tuple[int, int]]
) -> None:
    blob = _compact_blob().copy()
    for pos, mask in flips:
        blob[pos % blob.size] ^= mask
    for data in (blob, b"STCs" + junk):
        try:
            parts, ctx, count = decode_message(data, 100)
        except FrameError:
            continue
        assert ctx.numel == 100 and count >= 0
        assert sum(p.nbytes for p in parts) <= len(data)
