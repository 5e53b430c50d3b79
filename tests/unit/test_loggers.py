"""Callbacks, TensorBoard and MLflow: a ProgressDisplay fed as the metrics server feeds it,
and what each listener wrote, read back with the tools' own readers."""

import json
import logging
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from sparktrain.config import TrainConfig
from sparktrain.driver.services.loggers import (
    Callback,
    MLflowLogger,
    TensorBoardLogger,
    make_listeners,
    truncate,
)
from sparktrain.driver.services.metrics_server import ProgressDisplay, record_line
from sparktrain.errors import ConfigError

pytestmark = pytest.mark.timeout(60)

START = {"type": "start", "epochs": 3, "steps_per_epoch": 4, "world_size": 2, "train_samples": 64}


def _epoch(e, loss, metric, **extra):
    return {
        "type": "epoch",
        "epoch": e,
        "loss": loss,
        "metric_name": "accuracy",
        "metric": metric,
        "seconds": 0.5,
        **extra,
    }


EPOCHS = [_epoch(0, 1.0, 0.5, auc=0.6), _epoch(1, 0.5, 0.7, auc=0.8), _epoch(2, 0.25, 0.9, auc=0.9)]


def _run(display, messages, summary=None, model=None):
    for message in messages:
        display(message)
    display.close()
    display.finish(summary or {"final_loss": 0.25, "metric_value": 0.9}, model)


class Recorder(Callback):
    def __init__(self):
        self.begun = []
        self.seen = []
        self.ended = []

    def on_train_begin(self, info):
        self.begun.append(info)

    def on_epoch_end(self, record, history):
        self.seen.append((record, history))

    def on_train_end(self, summary, model):
        self.ended.append((summary, model))


# ---------------------------------------------------------------------- callbacks
def test_callbacks_class_and_function_get_every_record_and_the_growing_history(tmp_path):
    recorder = Recorder()
    calls = []
    cfg = TrainConfig(epochs=3)
    listeners = make_listeners(cfg, [recorder, lambda record, history: calls.append(history)])
    jsonl = tmp_path / "m.jsonl"
    display = ProgressDisplay(False, str(jsonl), listeners, config=cfg.to_dict())
    report = {"type": "report", "epoch": 3, "val_auc": 0.91, "loss": 0.2}
    model = nn.Linear(2, 1)
    _run(display, [START, *EPOCHS, report], model=model)

    assert len(recorder.begun) == 1
    assert recorder.begun[0]["world_size"] == 2
    assert recorder.begun[0]["config"]["epochs"] == 3
    records = [r for r, _ in recorder.seen]
    assert records == [*EPOCHS, report]
    assert [len(h) for _, h in recorder.seen] == [1, 2, 3, 4]
    assert all(h[-1] is r for r, h in recorder.seen)
    assert [[r["epoch"] for r in h] for h in calls] == [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3]]
    assert recorder.ended == [({"final_loss": 0.25, "metric_value": 0.9}, model)]
    # epochs as today; reports in the history and the JSON lines too
    assert display.epochs == EPOCHS
    assert display.history == [*EPOCHS, report]
    lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert lines == [*EPOCHS, report]


def test_a_raising_callback_is_logged_once_and_the_others_go_on(caplog):
    def broken(record, history):
        raise ValueError(f"bad callback at epoch {record['epoch']}")

    seen = []
    display = ProgressDisplay(
        False, "", make_listeners(TrainConfig(), [broken, lambda r, h: seen.append(r)])
    )
    with caplog.at_level(logging.DEBUG, logger="sparktrain.driver.services.loggers"):
        _run(display, [START, *EPOCHS])
    assert seen == EPOCHS
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert len(tracebacks) == 1
    assert "broken" in tracebacks[0].getMessage()
    assert "bad callback at epoch 0" in str(tracebacks[0].exc_info[1])
    assert any("failed 3 times" in r.getMessage() for r in caplog.records)


def test_a_resubmitted_stage_starts_the_run_once_and_rewinds_the_history():
    recorder = Recorder()
    display = ProgressDisplay(False, "", make_listeners(TrainConfig(), [recorder]))
    # attempt 0 reports epochs 0-2 and fails; attempt 1 resumes from epoch 1
    _run(display, [START, *EPOCHS, START, EPOCHS[1], EPOCHS[2]])
    assert len(recorder.begun) == 1
    assert [len(h) for _, h in recorder.seen] == [1, 2, 3, 2, 3]
    assert [r["epoch"] for r in display.history] == [0, 1, 2]
    assert len(display.epochs) == 5  # as today: every report, for history_before
    assert [r["epoch"] for r in display.history_before(8)] == [0, 1]


def test_records_before_any_start_still_start_the_run_and_nothing_follows_the_end():
    recorder = Recorder()
    display = ProgressDisplay(False, "", make_listeners(TrainConfig(), [recorder]))
    display(EPOCHS[0])  # rank 0's start message was lost
    display.finish({}, None)
    display(EPOCHS[1])  # a straggler after the end
    display.fail(RuntimeError("late"))
    assert recorder.begun == [{"type": "start", "config": {}}]
    assert [r for r, _ in recorder.seen] == [EPOCHS[0]]
    assert recorder.ended == [({}, None)]


def test_make_listeners_orders_loggers_first_and_refuses_a_non_callback(tmp_path):
    class Listener:  # the four methods: taken as is
        def on_start(self, info): ...
        def on_record(self, record, history): ...
        def on_finish(self, summary, model): ...
        def on_error(self, error): ...

    own = Listener()
    cfg = TrainConfig(tensorboard_dir=str(tmp_path / "tb"))
    listeners = make_listeners(cfg, [own])
    assert isinstance(listeners[0], TensorBoardLogger)
    assert listeners[1] is own
    assert make_listeners(TrainConfig()) == []
    with pytest.raises(ConfigError, match="neither a sparktrain.driver.services.loggers.Callback"):
        make_listeners(TrainConfig(), [42])


def test_the_log_line_keeps_the_epoch_format_and_lists_a_report_s_figures():
    assert record_line(_epoch(2, 0.2345, 0.9123)) == "epoch 3: loss 0.2345 accuracy 0.9123 (0.50 s)"
    assert (
        record_line(_epoch(0, 1.0, 0.5, auc=0.75))
        == "epoch 1: loss 1.0000 accuracy 0.5000 auc 0.7500 (0.50 s)"
    )
    report = {"type": "report", "epoch": 2, "val_auc": 0.91234, "loss": 0.23449, "rows": 7}
    assert record_line(report) == "epoch 3: val_auc 0.9123 loss 0.2345 rows 7"


def test_truncate_stays_within_the_limit():
    assert truncate("abc", 5) == "abc"
    assert truncate("abcdefgh", 6) == "abc..."
    assert truncate("abcdefgh", 2) == "ab"


# ---------------------------------------------------------------------- TensorBoard
def _no_listener_failed(caplog):
    # a listener's failure is only logged: the read-back alone could miss a lost hparams
    assert not [
        r.getMessage() for r in caplog.records if r.name == "sparktrain.driver.services.loggers"
    ]


def test_tensorboard_event_files_hold_every_figure_per_epoch(tmp_path, caplog):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = TrainConfig(epochs=3, tensorboard_dir=str(tmp_path / "tb"))
    display = ProgressDisplay(False, "", make_listeners(cfg), config=cfg.to_dict())
    report = {"type": "report", "epoch": 3, "val_auc": 0.95, "done": True}
    _run(display, [START, *EPOCHS, report])

    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    assert {"loss", "accuracy", "auc", "seconds", "val_auc"} <= set(acc.Tags()["scalars"])
    assert "done" not in acc.Tags()["scalars"]  # a boolean is no figure
    loss = acc.Scalars("loss")
    assert [e.step for e in loss] == [0, 1, 2]
    assert [e.value for e in loss] == pytest.approx([1.0, 0.5, 0.25])
    assert [e.value for e in acc.Scalars("accuracy")] == pytest.approx([0.5, 0.7, 0.9])
    assert [(e.step, e.value) for e in acc.Scalars("val_auc")] == [(3, pytest.approx(0.95))]
    # the config as text at the start, as hyperparameters at the end
    text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert '"tensorboard_dir"' in text
    assert acc.PluginTagToContent("hparams")
    _no_listener_failed(caplog)


def test_tensorboard_flushes_every_record(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(str(tmp_path))
    display = ProgressDisplay(False, "", [logger])
    display(START)
    display(EPOCHS[0])
    acc = EventAccumulator(str(tmp_path))  # read while the writer is still open
    acc.Reload()
    assert [e.value for e in acc.Scalars("loss")] == [1.0]
    display.fail(RuntimeError("stage failed"))


# ---------------------------------------------------------------------- MLflow
@pytest.fixture
def mlflow_uri(tmp_path, monkeypatch):
    # MLflow 3 keeps its file store only on request; it needs no server or database
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    return (tmp_path / "mlruns").as_uri()


def _only_run(uri, experiment):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1
    return client, runs[0]


def test_mlflow_run_holds_params_metric_histories_and_the_model(tmp_path, mlflow_uri, caplog):
    cfg = TrainConfig(
        epochs=3,
        optimizer="sgd",
        optimizer_kwargs={"momentum": 0.9},
        mlflow_tracking_uri=mlflow_uri,
        mlflow_experiment="sparktrain-test",
    )
    config = {**cfg.to_dict(), "note": "x" * 20_000}  # longer than MLflow takes
    display = ProgressDisplay(False, "", make_listeners(cfg), config=config)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    summary = {"final_loss": 0.25, "metric_value": 0.9, "history": [1, 2], "strategy": "ring"}
    _run(display, [START, *EPOCHS], summary=summary, model=model)

    client, run = _only_run(mlflow_uri, "sparktrain-test")
    assert run.info.status == "FINISHED"
    params = run.data.params
    assert params["lr"] == str(cfg.lr)
    assert params["optimizer"] == "sgd"
    assert params["optimizer_kwargs.momentum"] == "0.9"
    assert params["run.world_size"] == "2"
    assert params["note"].endswith("...") and len(params["note"]) < 20_000
    history = client.get_metric_history(run.info.run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == [(0, 1.0), (1, 0.5), (2, 0.25)]
    assert [m.value for m in client.get_metric_history(run.info.run_id, "accuracy")] == [
        0.5,
        0.7,
        0.9,
    ]
    assert run.data.metrics["summary.final_loss"] == 0.25
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"summary.json", "model"} <= artifacts
    saved = client.download_artifacts(run.info.run_id, "model/state_dict.pt", str(tmp_path))
    state = torch.load(saved, weights_only=True)
    assert state.keys() == model.state_dict().keys()
    for key, tensor in model.state_dict().items():
        assert torch.equal(state[key], tensor)
    got = json.loads(Path(client.download_artifacts(run.info.run_id, "summary.json")).read_text())
    assert got["strategy"] == "ring"
    _no_listener_failed(caplog)


def test_a_failed_fit_ends_the_mlflow_run_failed(mlflow_uri, caplog):
    logger = MLflowLogger(mlflow_uri, "failing")
    display = ProgressDisplay(False, "", [logger], config={"lr": 0.1})
    display(START)
    display(EPOCHS[0])
    display.fail(RuntimeError("the stage failed"))
    display.finish({}, None)  # ignored: the run already ended
    _, run = _only_run(mlflow_uri, "failing")
    assert run.info.status == "FAILED"
    assert run.data.tags["sparktrain.error"] == "RuntimeError: the stage failed"
    assert run.data.metrics["loss"] == 1.0
    _no_listener_failed(caplog)


def test_an_unusable_tracking_uri_fails_before_training():
    with pytest.raises(ConfigError, match="mlflow_tracking_uri='nosuchscheme://x'"):
        MLflowLogger("nosuchscheme://x", "e")


# ---------------------------------------------------------------------- missing packages
def test_a_missing_tensorboard_package_is_a_config_error(tmp_path, monkeypatch):
    # None in sys.modules: the import fails as if the package were not installed
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    cfg = TrainConfig(tensorboard_dir=str(tmp_path))
    with pytest.raises(ConfigError) as err:
        make_listeners(cfg)
    assert str(err.value) == (
        "tensorboard_dir needs the tensorboard package: pip install 'sparktrain[tensorboard]'"
    )


def test_a_missing_mlflow_package_is_a_config_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)
    cfg = TrainConfig(mlflow_tracking_uri="http://127.0.0.1:1")
    with pytest.raises(ConfigError) as err:
        make_listeners(cfg)
    assert str(err.value) == (
        "mlflow_tracking_uri needs the mlflow package: pip install 'sparktrain[mlflow]'"
    )
