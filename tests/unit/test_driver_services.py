"""Where the driver's services listen (driver_services_host/_ports) and what a task does
when it cannot reach them (no Spark here; the Spark side is
tests/integration/test_driver_services.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
import socket
from typing import Any

import pytest

from sparktrain import TrainConfig
from sparktrain.config import parse_port_range
from sparktrain.driver.barrier import without_driver
from sparktrain.driver.services.metrics_server import ProgressDisplay
from sparktrain.driver.services.rendezvous import (
    REACH_TIMEOUT_S,
    DriverUnreachable,
    RendezvousServer,
    all_gather,
)
from sparktrain.errors import ConfigError, HandshakeError
from sparktrain.task.context import JobSpec
from sparktrain.wire import handshake
from sparktrain.wire.listen import ServiceHost, address_of, open_listener, open_service_listener

HOST = "127.0.0.1"


def free_stretch(width: int) -> int:
    """The first port of ``width`` ports nothing on this host listens on (probed)."""
    for low in range(41000, 60000, 97):
        with contextlib.ExitStack() as stack:
            try:
                for port in range(low, low + width):
                    sock = stack.enter_context(socket.socket())
                    sock.bind((HOST, port))
            except OSError:
                continue
            return low
    raise AssertionError("no free stretch of ports")


@pytest.mark.parametrize(
    ("text", "want"), [("", None), ("40000-40099", (40000, 40099)), ("45000", (45000, 45000))]
)
def test_port_ranges_parse(text: str, want: tuple[int, int] | None) -> None:
    assert parse_port_range(text) == want


@pytest.mark.parametrize("text", ["80-90", "50000-40000", "a-b", "40000-70000", "1-"])
def test_bad_port_ranges_say_what_to_give(text: str) -> None:
    with pytest.raises(ConfigError, match="LOW-HIGH"):
        TrainConfig(driver_services_ports=text)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "*"])
def test_a_wildcard_services_host_is_refused(host: str) -> None:
    with pytest.raises(ConfigError, match="never a wildcard"):
        TrainConfig(driver_services_host=host)


def test_services_take_the_first_free_ports_of_their_range() -> None:
    low = free_stretch(3)
    host = ServiceHost(HOST, (low, low + 2))
    taken = open_listener(HOST, low)  # someone else holds the first port
    try:
        first = open_service_listener(host)
        second = open_service_listener(host)
        ports = [int(address_of(s).rsplit(":", 1)[1]) for s in (first, second)]
        assert ports == [low + 1, low + 2]
        with pytest.raises(ConfigError, match=f"{low}-{low + 2}.*widen"):
            open_service_listener(host)
    finally:
        for sock in (taken, first, second):
            sock.close()


def test_a_service_listens_in_its_range() -> None:
    low = free_stretch(4)
    server = RendezvousServer(
        ServiceHost(HOST, (low, low + 3)),
        secret=secrets.token_bytes(32),
        job_id="job",
        attempt=0,
        world_size=1,
    )
    try:
        assert low <= int(server.address.rsplit(":", 1)[1]) <= low + 3
    finally:
        server.stop()


class _DialClock:
    """The dial's clock (:mod:`time` in wire/handshake.py): it moves only by the pauses
    between refused dials, which it records instead of sleeping."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.paused = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.paused += seconds
        self.now += seconds


def test_a_closed_port_is_an_unreachable_driver_before_comm_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    listener = open_listener(HOST)
    dead = address_of(listener)
    listener.close()
    clock = _DialClock()
    monkeypatch.setattr(handshake, "time", clock)
    with pytest.raises(DriverUnreachable, match=f"rank 1 cannot reach .*{dead}"):
        all_gather(dead, secret=b"s" * 32, job_id="j", attempt=0, rank=1, message="m", timeout=30.0)
    # it gave up after REACH_TIMEOUT_S of refused dials, long before comm_timeout
    assert clock.paused == pytest.approx(REACH_TIMEOUT_S) and REACH_TIMEOUT_S < 30.0


def test_a_driver_that_refuses_the_task_is_not_unreachable() -> None:
    server = RendezvousServer(
        HOST, secret=secrets.token_bytes(32), job_id="job", attempt=0, world_size=1
    )
    try:
        with pytest.raises(HandshakeError) as caught:
            all_gather(
                server.address,
                secret=secrets.token_bytes(32),  # not the job's
                job_id="job",
                attempt=0,
                rank=0,
                message="m",
                timeout=5.0,
            )
        assert not isinstance(caught.value, DriverUnreachable)
    finally:
        server.stop()


def spec_with(**fields: Any) -> JobSpec:
    base = JobSpec(
        job_id="j",
        attempt=0,
        secret=b"s" * 32,
        config=TrainConfig(progress=False),
        model_fn=None,
        model_kwargs={},
        feature_width=4,
        num_outputs=3,
        metrics_address="h:1",
        rendezvous_address="h:2",
        state_address="h:3",
    )
    return dataclasses.replace(base, **fields)


def test_a_cut_off_task_forgets_the_driver_addresses() -> None:
    spec = without_driver(spec_with(), DriverUnreachable("rank 0 cannot reach h:2"))
    assert (spec.metrics_address, spec.rendezvous_address, spec.state_address) == (
        None,
        None,
        None,
    )


@pytest.mark.parametrize("fields", [{"ps_addresses": ("h:4",)}, {"ps_bootstrap": "h:5"}])
def test_a_cut_off_parameter_server_task_says_what_to_set(fields: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="driver_services_host.*strategy='ring' or 'tree'"):
        without_driver(spec_with(**fields), DriverUnreachable("rank 0 cannot reach h:2"))


def test_replayed_history_reaches_listeners_and_jsonl_once(tmp_path: Any) -> None:
    seen: list[int] = []

    class Listener:
        def on_start(self, message: dict[str, Any]) -> None:
            pass

        def on_epoch_end(self, record: dict[str, Any], history: list[dict[str, Any]]) -> None:
            seen.append(record["epoch"])

    jsonl = tmp_path / "m.jsonl"
    display = ProgressDisplay(False, str(jsonl), listeners=[_adapt(Listener())])
    history = [{"type": "epoch", "epoch": e, "loss": 1.0 / (e + 1)} for e in range(3)]
    display.replay(history)
    display.replay(history)  # already there: nothing twice
    assert seen == [0, 1, 2]
    assert len(jsonl.read_text().splitlines()) == 3


def _adapt(listener: Any) -> Any:
    from sparktrain.driver.services.loggers import make_listeners

    return make_listeners(TrainConfig(progress=False), [listener.on_epoch_end])[0]
