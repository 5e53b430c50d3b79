"""The progress channel: rank 0 -> driver over the authenticated wire."""

import json
import time

import pytest

from sparktrain.driver.services.metrics_server import MetricsServer, ProgressDisplay
from sparktrain.task.metrics_client import MetricsClient

pytestmark = pytest.mark.timeout(30)

SECRET = b"s" * 32


def _until(predicate):
    """Poll ``predicate`` until it holds (the test's timeout bounds the wait)."""
    while not predicate():
        time.sleep(0.02)


def test_epochs_reach_the_display_and_the_jsonl(tmp_path):
    path = tmp_path / "metrics.jsonl"
    display = ProgressDisplay(enabled=False, jsonl_path=str(path))
    server = MetricsServer("127.0.0.1", secret=SECRET, job_id="j", attempt=0, on_message=display)
    try:
        client = MetricsClient(server.address, secret=SECRET, job_id="j", attempt=0, timeout=5)
        client.send({"type": "start", "epochs": 2, "steps_per_epoch": 3})
        for epoch in range(2):
            client.send(
                {
                    "type": "epoch",
                    "epoch": epoch,
                    "loss": 1.0 / (epoch + 1),
                    "metric_name": "accuracy",
                    "metric": 0.5,
                    "seconds": 0.1,
                }
            )
        _until(lambda: len(display.epochs) == 2)
        client.close()
    finally:
        server.stop()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["epoch"] for line in lines] == [0, 1]


def test_a_client_with_the_wrong_secret_is_ignored_and_training_goes_on(caplog):
    display = ProgressDisplay(enabled=False)
    server = MetricsServer("127.0.0.1", secret=SECRET, job_id="j", attempt=0, on_message=display)
    try:
        intruder = MetricsClient(server.address, secret=b"x" * 32, job_id="j", attempt=0, timeout=2)
        # the server refused it in the handshake, before the client could send anything
        assert "progress channel to the driver unavailable" in caplog.text
        assert "rejected this rank" in caplog.text
        intruder.send({**_epoch(0), "loss": 0.0, "metric": 1.0})  # swallowed, never raises
        client = MetricsClient(server.address, secret=SECRET, job_id="j", attempt=0, timeout=5)
        client.send(_epoch(7))
        _until(lambda: display.epochs)
        client.close()
    finally:
        server.stop()
    assert [e["epoch"] for e in display.epochs] == [7]  # the real client's, alone
    assert not server._thread.is_alive()  # stop() ended the accept loop


def _epoch(epoch: int) -> dict:
    return {
        "type": "epoch",
        "epoch": epoch,
        "loss": 1.0,
        "metric_name": "accuracy",
        "metric": 0.5,
        "seconds": 0.1,
    }


def test_stop_delivers_what_rank_0_sent_before_it_closed_to_a_slow_listener():
    seen: list[int] = []

    def slow(message):  # a listener slower than training: messages queue in the socket
        time.sleep(0.1)
        seen.append(message["epoch"])

    server = MetricsServer("127.0.0.1", secret=SECRET, job_id="j", attempt=0, on_message=slow)
    try:
        client = MetricsClient(server.address, secret=SECRET, job_id="j", attempt=0, timeout=5)
        for epoch in range(8):
            client.send(_epoch(epoch))
        _until(lambda: seen)  # the reader is busy with the first one
        client.close()  # the task ended; the stage returns before the listener caught up
    finally:
        server.stop()
    assert seen == list(range(8))


def test_stop_does_not_wait_for_a_client_that_is_connected_but_silent(caplog):
    display = ProgressDisplay(enabled=False)
    server = MetricsServer("127.0.0.1", secret=SECRET, job_id="j", attempt=0, on_message=display)
    client = MetricsClient(server.address, secret=SECRET, job_id="j", attempt=0, timeout=600)
    try:
        client.send(_epoch(0))
        _until(lambda: len(display.epochs) == 1)
        # e.g. a failed stage whose rank 0 still lives: stop() returns once the reader has
        # been idle DRAIN_IDLE_S, neither at the drain limit (60 s, past this test's
        # timeout) nor when the client's connection times out (600 s)
        server.stop()
        assert "took over" not in caplog.text  # it did not give up at the drain limit
    finally:
        client.close()
        server.stop()
