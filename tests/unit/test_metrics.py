"""The progress channel: rank 0 -> driver over the authenticated wire."""

import json
import time

import pytest

from sparktrain.driver.services.metrics_server import MetricsServer, ProgressDisplay
from sparktrain.task.metrics_client import MetricsClient

pytestmark = pytest.mark.timeout(30)

SECRET = b"s" * 32


def _wait_for(predicate, seconds=5.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


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
        assert _wait_for(lambda: len(display.epochs) == 2)
        client.close()
    finally:
        server.stop()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["epoch"] for line in lines] == [0, 1]


@pytest.mark.timing
def test_a_client_with_the_wrong_secret_is_ignored_and_training_goes_on():
    display = ProgressDisplay(enabled=False)
    server = MetricsServer("127.0.0.1", secret=SECRET, job_id="j", attempt=0, on_message=display)
    try:
        intruder = MetricsClient(server.address, secret=b"x" * 32, job_id="j", attempt=0, timeout=2)
        intruder.send(
            {
                "type": "epoch",
                "epoch": 0,
                "loss": 0.0,
                "metric_name": "accuracy",
                "metric": 1.0,
                "seconds": 0.0,
            }
        )  # swallowed, never raises
        assert not _wait_for(lambda: display.epochs, seconds=0.5)
    finally:
        started = time.monotonic()
        server.stop()
        assert time.monotonic() - started < 6


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
        assert _wait_for(lambda: seen)  # the reader is busy with the first one
        client.close()  # the task ended; the stage returns before the listener caught up
    finally:
        server.stop()
    assert seen == list(range(8))


@pytest.mark.timing
def test_stop_does_not_wait_for_a_client_that_is_connected_but_silent():
    display = ProgressDisplay(enabled=False)
    server = MetricsServer("127.0.0.1", secret=SECRET, job_id="j", attempt=0, on_message=display)
    client = MetricsClient(server.address, secret=SECRET, job_id="j", attempt=0, timeout=5)
    try:
        client.send(_epoch(0))
        assert _wait_for(lambda: len(display.epochs) == 1)
        started = time.monotonic()
        server.stop()  # e.g. a failed stage whose rank 0 still lives
        assert time.monotonic() - started < 2
    finally:
        client.close()
        server.stop()
