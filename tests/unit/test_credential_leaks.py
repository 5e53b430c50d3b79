"""A tracking URI's credentials reach no record of the run: not TensorBoard's text and
hyperparameters, not MLflow's parameters, tags and summary artifact, not the summary,
not the log. The MLflow client itself still gets the URI whole."""

import logging
import socket
from pathlib import Path

import pytest
import torch
from torch import nn

from sparktrain.config import TrainConfig
from sparktrain.driver.services.loggers import MLflowLogger, TensorBoardLogger, make_listeners
from sparktrain.driver.services.metrics_server import ProgressDisplay
from sparktrain.errors import ConfigError
from sparktrain.redact import redact_text, redact_values
from sparktrain.result import TrainResult

pytestmark = pytest.mark.timeout(60)

SECRETS = ("s3cret", "tok123")
START = {"type": "start", "epochs": 1, "steps_per_epoch": 2, "world_size": 2}
EPOCH = {"type": "epoch", "epoch": 0, "loss": 0.5, "metric_name": "accuracy", "metric": 0.8}


def _assert_clean(text: str) -> None:
    for secret in SECRETS:
        assert secret not in text


def _files_text(root: Path) -> str:
    return "\n".join(
        p.read_bytes().decode("utf-8", "replace") for p in sorted(root.rglob("*")) if p.is_file()
    )


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("https://me:s3cret@mlflow.example.com:5000/", "https://mlflow.example.com:5000/"),
        (
            "https://mlflow.example.com/?token=tok123&x=1",
            "https://mlflow.example.com/?token=***&x=1",
        ),
        (
            "http://h/?api_key=a;sig=b&Password=c&keep=1",
            "http://h/?api_key=***;sig=***&Password=***&keep=1",
        ),
        ("http://u:p@ss@host/path", "http://host/path"),  # greedy to the last "@", as urlsplit
        ("error: 'https://u:s3cret@h/x' failed", "error: 'https://h/x' failed"),
        # nothing secret: unchanged
        ("databricks", "databricks"),
        ("file:///tmp/mlruns", "file:///tmp/mlruns"),
        ("me@example.com/experiments", "me@example.com/experiments"),
        ("", ""),
    ],
)
def test_redact_text_removes_userinfo_and_secret_query_values(raw, shown):
    assert redact_text(raw) == shown


def test_redact_values_walks_nested_configs_and_keeps_other_values():
    value = {"a": ["https://u:s3cret@h/", 1, None], "b": {"c": ("x", 2.5)}, "d": True}
    assert redact_values(value) == {"a": ["https://h/", 1, None], "b": {"c": ("x", 2.5)}, "d": True}
    assert value["a"][0] == "https://u:s3cret@h/"  # a copy: the input is left alone


def test_tensorboard_text_and_hparams_hold_no_credentials(tmp_path):
    uri = "https://me:s3cret@mlflow.example.com/?token=tok123"
    cfg = TrainConfig(epochs=1, mlflow_tracking_uri=uri, tensorboard_dir=str(tmp_path / "tb"))
    display = ProgressDisplay(
        False, "", [TensorBoardLogger(str(tmp_path / "tb"))], config=cfg.to_dict()
    )
    display(START)
    display(EPOCH)
    display.close()
    display.finish({"config": cfg.to_dict()}, None)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0})
    acc.Reload()
    text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "https://mlflow.example.com/?token=***" in text  # still says where the run went
    _assert_clean(_files_text(tmp_path / "tb"))  # text, hparams, every event byte


@pytest.fixture
def mlflow_root(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3: a file store on request
    return tmp_path / "mlruns"


def test_mlflow_params_tags_and_summary_artifact_hold_no_credentials(mlflow_root):
    # a file store takes (and ignores) userinfo and query: the real client, no server
    uri = f"file://me:s3cret@localhost{mlflow_root}?token=tok123"
    cfg = TrainConfig(epochs=1, mlflow_tracking_uri=uri, mlflow_experiment="leaks")
    listeners = make_listeners(cfg)
    (logger,) = listeners
    assert isinstance(logger, MLflowLogger)
    assert logger._client.tracking_uri == uri  # the client gets the URI whole
    display = ProgressDisplay(False, "", listeners, config=cfg.to_dict())
    display(START)
    display(EPOCH)
    display.close()
    display.finish({"final_loss": 0.5, "config": cfg.to_dict()}, nn.Linear(2, 1))

    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow_root.as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("leaks").experiment_id])
    shown = run.data.params["mlflow_tracking_uri"]
    assert shown == f"file://localhost{mlflow_root}?token=***"
    _assert_clean(repr(run.data.params) + repr(run.data.tags))
    summary = Path(
        client.download_artifacts(run.info.run_id, "summary.json", str(mlflow_root.parent))
    )
    assert '"final_loss": 0.5' in summary.read_text()
    _assert_clean(summary.read_text())
    # every file of the run but MLflow's own meta.yaml, whose artifact_uri a file store
    # derives from the URI it was given (a tracking server sets its own)
    run_dir = next(mlflow_root.rglob(run.info.run_id))
    _assert_clean(
        "\n".join(
            p.read_text("utf-8", "replace")
            for p in run_dir.rglob("*")
            if p.is_file() and p.name != "meta.yaml"
        )
    )


def test_an_mlflow_error_tag_holds_no_credentials(mlflow_root):
    logger = MLflowLogger(mlflow_root.as_uri(), "leaks-failed")
    display = ProgressDisplay(False, "", [logger])
    display(START)
    display.fail(RuntimeError("cannot reach https://me:s3cret@data.example.com/x?sig=tok123"))
    run = logger._client.get_run(logger.run_id)
    assert run.data.tags["sparktrain.error"] == (
        "RuntimeError: cannot reach https://data.example.com/x?sig=***"
    )
    _assert_clean(repr(run.data.tags))


def test_the_summary_holds_no_credentials(tmp_path):
    uri = "https://me:s3cret@mlflow.example.com/?token=tok123"
    summary = {"final_loss": 0.5, "config": TrainConfig(mlflow_tracking_uri=uri).to_dict()}
    result = TrainResult(model=nn.Linear(2, 1), history=[], summary=summary)
    assert result.summary["config"]["mlflow_tracking_uri"] == (
        "https://mlflow.example.com/?token=***"
    )
    assert summary is result.summary  # in place: a builder holding the dict sees it too
    result.save_summary(tmp_path / "summary.json")
    _assert_clean((tmp_path / "summary.json").read_text())


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_log_lines_and_tracebacks_hold_no_credentials(monkeypatch, caplog):
    # MLflow's REST error names the request URL, userinfo and all: fail fast, no retries
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    uri = f"http://me:s3cret@127.0.0.1:{_closed_port()}"
    logger = MLflowLogger(uri, "leaks-log")
    display = ProgressDisplay(False, "", [logger])
    with caplog.at_level(logging.DEBUG, logger="sparktrain.driver.services.loggers"):
        display(START)  # on_start cannot reach the server: logged, training goes on
        display.close()
        display.finish({}, None)
    failures = [r for r in caplog.records if r.exc_info]
    assert len(failures) == 1
    assert "s3cret" in str(failures[0].exc_info[1])  # MLflow's own words hold it...
    assert "127.0.0.1" in caplog.text
    _assert_clean(caplog.text)  # ...the log does not


def test_an_unusable_tracking_uri_error_holds_no_credentials():
    with pytest.raises(ConfigError) as info:
        MLflowLogger("nosuchscheme://me:s3cret@host/?token=tok123", "x")
    assert "nosuchscheme://host/?token=***" in str(info.value)
    _assert_clean(str(info.value))
    assert info.value.__cause__ is None  # the chained error would print the URI whole


def test_listeners_see_the_redacted_config_and_summary():
    class Starts:
        def __init__(self):
            self.configs = []

        def on_start(self, info):
            self.configs.append(info["config"])

        def on_record(self, record, history):
            pass

        def on_finish(self, summary, model):
            self.configs.append(summary["config"])

        def on_error(self, error):
            pass

    starts = Starts()
    cfg = TrainConfig(mlflow_tracking_uri="https://me:s3cret@h/")
    display = ProgressDisplay(False, "", [starts], config=cfg.to_dict())
    display(START)
    display.close()
    display.finish({"config": cfg.to_dict()}, torch.nn.Identity())
    assert [c["mlflow_tracking_uri"] for c in starts.configs] == ["https://h/", "https://h/"]
