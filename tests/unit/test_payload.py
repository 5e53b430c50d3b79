"""Big task payloads from a driver service (Spark Connect's request cap): the size
decision, the service's round trip on loopback, what a task says when it cannot reach
the service, the barrier stage's served task, and transform's weights kept on the
service while their model lives."""

from __future__ import annotations

import functools
import gc
import secrets
import time
from collections.abc import Iterator
from typing import Any

import pytest

from sparktrain.driver.services.payload_server import (
    STAGE_REMEDY,
    ClosureShipper,
    PayloadServer,
    fits_in_closure,
)
from sparktrain.errors import CommError, ConfigError, HandshakeError
from sparktrain.task.payload_client import ServedBytes, ServedTask, fetch_payload
from sparktrain.wire.security import WireSecurity

HOST = "127.0.0.1"
AUTH: dict[str, Any] = {"secret": secrets.token_bytes(32), "job_id": "payload-test"}


def test_a_payload_rides_in_the_closure_up_to_half_the_cap() -> None:
    cap = 4 << 20
    assert fits_in_closure(2 << 20, cap)
    assert not fits_in_closure((2 << 20) + 1, cap)
    assert fits_in_closure(10**12, None)  # a classic session: no cap


@pytest.fixture
def server() -> Iterator[PayloadServer]:
    # small frames: a payload of several chunks, as a real model's is
    served = PayloadServer(HOST, chunk_bytes=64 << 10, **AUTH)
    try:
        yield served
    finally:
        served.stop()


def test_a_served_payload_arrives_whole_in_chunks_until_discarded(server: PayloadServer) -> None:
    blob = bytes(range(256)) * 5000 + b"tail"  # 1.28 MB, not a multiple of the chunk
    ref = server.add(blob, what="a test payload", timeout=10.0, remedy="")
    assert ref.nbytes == len(blob) and ref.address == server.address
    assert fetch_payload(ref, rank=1) == blob
    assert ref.value == blob  # a task's read: one more fetch
    # the server counts a fetch once its send returned, which may be just after the task
    # has read the last chunk: wait for the count, a bounded number of times
    for _ in range(500):
        if server.fetches == 2:
            break
        time.sleep(0.01)
    assert (server.fetches, server.sent_bytes) == (2, 2 * len(blob))
    server.discard(ref.key)
    with pytest.raises(CommError, match="no longer served"):
        fetch_payload(ref, rank=0)
    assert server.payloads == 0


def test_a_stranger_without_the_secret_gets_nothing(server: PayloadServer) -> None:
    ref = server.add(b"secret weights", what="a test payload", timeout=5.0, remedy="")
    forged = ServedBytes(
        address=ref.address,
        key=ref.key,
        nbytes=ref.nbytes,
        what=ref.what,
        secret=secrets.token_bytes(32),
        job_id=ref.job_id,
        timeout=5.0,
    )
    with pytest.raises(HandshakeError):
        fetch_payload(forged, rank=0)
    assert server.fetches == 0


def test_a_service_out_of_reach_is_an_error_that_says_what_to_set(server: PayloadServer) -> None:
    ref = server.add(b"x" * 10, what="this stage's task", timeout=0.5, remedy=STAGE_REMEDY)
    server.stop()  # nothing listens on its port any more
    with pytest.raises(ConfigError) as caught:
        fetch_payload(ref, rank=0)
    text = str(caught.value)
    assert ref.address in text and "this stage's task" in text
    assert "driver_services_host" in text and "maxInboundMessageSize" in text


def _double(scale: int, batches: Iterator[int]) -> Iterator[int]:
    for b in batches:
        yield b * scale


def test_the_stage_task_ships_as_is_while_small_and_else_from_the_service() -> None:
    security = WireSecurity.for_job()
    small = ClosureShipper(4 << 20, HOST, attempt=0, security=security, timeout=10.0, **AUTH)
    task = functools.partial(_double, 3)
    assert small.ship(task) is task
    assert small.summary()["via"] == "closure" and small.server is None
    # a task that closes over a payload of 3 MiB under a 4 MiB cap
    big = ClosureShipper(4 << 20, HOST, attempt=2, security=security, timeout=10.0, **AUTH)
    try:
        shipped = big.ship(functools.partial(_with_payload, b"w" * (3 << 20)))
        assert isinstance(shipped, ServedTask) and shipped.body.attempt == 2
        assert shipped.body.nbytes > 3 << 20
        assert list(shipped(iter([1, 2]))) == [3 << 20, 3 << 20]  # fetched, unpickled, run
        # the server counts a fetch after its last send, which may be after the reader
        # returned: wait for it (bounded)
        deadline = time.monotonic() + 5.0
        while big.summary()["fetches"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert big.summary() == {
            "bytes": shipped.body.nbytes,
            "via": "driver service",
            "fetches": 1,
        }
    finally:
        big.stop()


def _with_payload(payload: bytes, batches: Iterator[int]) -> Iterator[int]:
    for _ in batches:
        yield len(payload)


class _Conf:
    def __init__(self, values: dict[str, str]) -> None:
        self.values = values

    def get(self, key: str, default: str | None = None) -> str | None:
        return self.values.get(key, default)


class _ConnectSession:
    """Stands in for a Spark Connect session (by its module's name): a conf, no server
    URL (the services then listen on spark.driver.host, here 127.0.0.1)."""

    def __init__(self, conf: dict[str, str]) -> None:
        self.conf = _Conf({"spark.master": "local[2]", "spark.driver.host": HOST, **conf})


_ConnectSession.__module__ = "pyspark.sql.connect.session"


def test_transform_weights_stay_served_while_their_model_lives() -> None:
    from sparktrain.driver.spark_env import ConnectEnv
    from sparktrain.ml import TorchClassificationModel

    env = ConnectEnv(_ConnectSession({"spark.connect.grpc.maxInboundMessageSize": "1k"}))
    model = TorchClassificationModel()._set_state(b"m" * 4096, num_features=4, num_outputs=2)
    first = model._shipped_weights(env)
    assert isinstance(first, ServedBytes)
    assert model._shipped_weights(env) is first  # a later transform reuses it
    copy = model.copy()
    assert copy._shipped_weights(env) is not first  # each copy serves its own
    assert first.value == b"m" * 4096
    del model
    gc.collect()
    with pytest.raises(CommError, match="no longer served"):
        first.value  # noqa: B018 - the read is the fetch
    assert copy._shipped_weights(env).value == b"m" * 4096  # the copy's still is


def test_the_shared_server_serves_over_tls_when_asked() -> None:
    from sparktrain.driver.services.payload_server import _SHARED, discard_shared, serve_shared

    def serve(blob: bytes) -> ServedBytes:
        return serve_shared(
            blob, host=HOST, ports=None, tls=True, what="weights", timeout=10.0, remedy=""
        )

    ref, other = serve(b"t" * 100_000), serve(b"u" * 10)
    assert other.address == ref.address  # one server per address and security
    (server,) = [s for s in _SHARED.values() if s.address == ref.address]
    assert ref.security is not None and ref.security.tls_fingerprint
    assert ref.value == b"t" * 100_000
    plain = ServedBytes(**{**ref.__dict__, "security": None})  # no TLS: no connection
    with pytest.raises(ConfigError, match="could not reach"):
        fetch_payload(plain, rank=0)
    discard_shared(ref)
    assert server.payloads == 1 and not server.stopping
    discard_shared(other)  # the last payload: the server and its thread go too
    assert server.stopping and server not in _SHARED.values()
