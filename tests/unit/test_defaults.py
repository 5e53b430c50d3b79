"""Defaults that train (issue 34): what TrainConfig defaults to, which keys a config was
given, the once-a-process notice of changed defaults a fit runs on, SGD's settings under
another optimizer, the wrapper that lets a model trained on standardised features take raw
ones, and how each way in applies the ``"auto"`` scalings. No Spark."""

from __future__ import annotations

import pickle
import warnings
from typing import Any

import pytest
import torch

from sparktrain import DefaultsChangedWarning
from sparktrain.builders import FeatureScaled
from sparktrain.config import (
    CHANGED_DEFAULTS,
    TrainConfig,
    apply_overrides,
    changed_defaults_in_effect,
    changed_defaults_notice,
)
from sparktrain.driver import job
from sparktrain.errors import ConfigError
from sparktrain.models import mlp


def test_the_defaults_are_the_ones_that_train() -> None:
    cfg = TrainConfig()
    assert (cfg.optimizer, cfg.lr, cfg.epochs, cfg.batch_size) == ("adam", 0.001, 50, 32)
    assert (cfg.label_scaling, cfg.feature_scaling) == ("auto", "auto")
    for change in CHANGED_DEFAULTS:  # the table names today's defaults
        assert getattr(cfg, change.key) == change.new, change.key


def test_a_config_knows_the_keys_it_was_given() -> None:
    cfg = TrainConfig(num_workers=4, lr=0.05)
    assert cfg.given_keys == {"num_workers", "lr"}
    assert cfg.replace(epochs=3).given_keys == {"num_workers", "lr", "epochs"}
    assert pickle.loads(pickle.dumps(cfg)).given_keys == cfg.given_keys
    toml = TrainConfig.from_dict(apply_overrides({"epochs": 5}, ["label_scaling=false"]))
    assert toml.given_keys == {"epochs", "label_scaling"} and toml.label_scaling is False
    assert TrainConfig().given_keys == frozenset()
    assert cfg.given_only(["seed"]).given_keys == {"seed"}


def test_a_fit_on_changed_defaults_is_told_which_and_how_to_keep_the_old() -> None:
    assert (
        changed_defaults_notice(
            TrainConfig(optimizer="sgd", lr=0.01, epochs=10, feature_scaling=False)
        )
        == ""
    )  # label_scaling's "auto" changes nothing for cross-entropy
    notice = changed_defaults_notice(TrainConfig())
    assert "optimizer 'sgd' -> 'adam'" in notice and "epochs 10 -> 50" in notice
    assert "set optimizer='sgd', lr=0.01, epochs=10, feature_scaling=false" in notice
    assert "label_scaling" not in notice and "lr=" not in notice.partition("set")[0]
    regression = [c.key for c in changed_defaults_in_effect(TrainConfig(loss="mse"))]
    assert "label_scaling" in regression
    # the setting the user gave whose meaning changed comes first
    tuned = changed_defaults_notice(TrainConfig(lr=0.05))
    assert tuned.startswith("lr=0.05 is given for the default optimizer, which is 'adam'")
    assert "set optimizer='sgd' to keep SGD" in tuned
    assert "optimizer=" not in changed_defaults_notice(TrainConfig(lr=0.05, optimizer="adam"))


def test_the_notice_is_a_warning_said_once_a_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(job, "_ANNOUNCED", set())
    with pytest.warns(DefaultsChangedWarning, match="changed in sparktrain 0.2"):
        job.announce_changed_defaults(TrainConfig())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        job.announce_changed_defaults(TrainConfig())  # said already: silent
        job.announce_changed_defaults(
            TrainConfig(optimizer="sgd", lr=0.01, epochs=10, feature_scaling=False)
        )  # nothing changed for this one
        job.announce_changed_defaults(TrainConfig(epochs=3))  # fewer changes: said already
    with pytest.warns(DefaultsChangedWarning, match="lr=0.05 is given"):
        job.announce_changed_defaults(TrainConfig(lr=0.05))  # a rate for SGD: said too
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        job.announce_changed_defaults(TrainConfig(lr=0.2))


def test_sgd_settings_without_sgd_say_to_set_it_and_the_fix_works() -> None:
    old = {"lr": 0.1, "optimizer_kwargs": {"momentum": 0.9, "nesterov": True}}
    with pytest.raises(ConfigError, match="momentum, nesterov are SGD's settings") as err:
        TrainConfig.from_dict(old)
    message = str(err.value)
    assert "the default optimizer is 'adam' since sparktrain 0.2 (it was 'sgd')" in message
    fix = message.partition("set ")[2].split()[0]  # pasted after --set
    assert fix == "optimizer='sgd'"
    assert TrainConfig.from_dict(apply_overrides(old, [fix])).optimizer == "sgd"
    with pytest.raises(ConfigError, match="optimizer='adamw' does not take"):
        TrainConfig(optimizer="adamw", optimizer_kwargs={"dampening": 0.1})
    TrainConfig(optimizer="adam", optimizer_kwargs={"betas": [0.9, 0.99]})  # Adam's own


@pytest.mark.parametrize("value", ["auto", "AUTO", True, "true", False, "False"])
def test_the_scalings_take_true_false_or_auto(value: Any) -> None:
    cfg = TrainConfig(loss="mse", label_scaling=value, feature_scaling=value)
    want = "auto" if str(value).lower() == "auto" else str(value).lower() == "true"
    assert cfg.label_scaling == want and cfg.feature_scaling == want
    with pytest.raises(ConfigError, match='feature_scaling=.yes. must be true, false or "auto"'):
        TrainConfig(feature_scaling="yes")


def test_the_feature_scaled_model_takes_raw_features_and_saves_its_figures() -> None:
    torch.manual_seed(0)
    inner = mlp(3, (4,), 2)
    mean, std = torch.tensor([10.0, -2.0, 0.0]), torch.tensor([5.0, 0.5, 1.0])
    model = FeatureScaled(inner, mean.numpy(), std.numpy())
    x = torch.randn(6, 3) * std + mean
    assert torch.allclose(model(x), inner((x - mean) / std), atol=1e-6)
    assert model.forwards_to is inner
    state = model.state_dict()
    assert {"feature_mean", "feature_std"} <= set(state) and "inner.0.weight" in state
    again = FeatureScaled(mlp(3, (4,), 2), torch.zeros(3).numpy(), torch.ones(3).numpy())
    again.load_state_dict(state)
    assert torch.equal(again(x), model(x))


@pytest.mark.parametrize(
    ("way", "loss", "want"),
    [
        ("fit", "mse", ("auto", "auto")),
        ("fit", "cross_entropy", (False, "auto")),
        ("run", "mse", (False, False)),
        ("torch_run", "mse", (False, False)),
    ],
)
def test_each_way_in_applies_the_auto_scalings_its_way(way: Any, loss: str, want: tuple) -> None:
    opened = job.OpenJob(None, None, TrainConfig(loss=loss), None, way)  # type: ignore[arg-type]
    assert opened.scaling() == want
    given = TrainConfig(loss="mse", label_scaling=True, feature_scaling=True)
    explicit = job.OpenJob(None, None, given, None, way)  # type: ignore[arg-type]
    assert explicit.scaling() == (True, True)  # asked for: an error where it cannot apply


def test_an_estimator_learning_rate_set_for_sgd_is_told_about_adam() -> None:
    from sparktrain.ml import TorchClassifier

    set_rate = TorchClassifier(modelFn="sparktrain.models:digits_mlp", learningRate=0.05)
    cfg = set_rate._train_config()
    assert cfg.given_keys == {"lr"}
    assert changed_defaults_notice(cfg).startswith("lr=0.05 is given for the default optimizer")
    chosen = TorchClassifier(
        modelFn="sparktrain.models:digits_mlp", learningRate=0.05, optimizer="adam"
    )
    assert "lr=0.05" not in changed_defaults_notice(chosen._train_config())


def test_feature_scaling_auto_leaves_an_embeddings_indices_alone() -> None:
    from torch import nn

    from sparktrain.trainer import takes_indices

    assert takes_indices(nn.Sequential(nn.Linear(4, 2))) is None
    why = takes_indices(nn.Sequential(nn.Embedding(10, 3), nn.Flatten(), nn.Linear(3, 1)))
    assert why == "the model's 0 is an Embedding, whose inputs are indices"
    assert "EmbeddingBag" in str(takes_indices(nn.EmbeddingBag(10, 3)))
