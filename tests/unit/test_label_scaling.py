"""label_scaling without Spark: the config's checks, the wrapper that brings outputs back
to label units, and metrics reported in label units."""

from __future__ import annotations

import math

import pytest
import torch

from sparktrain import TrainConfig
from sparktrain.builders import LabelScaled
from sparktrain.data.batch import forward_params
from sparktrain.errors import ConfigError
from sparktrain.models import mlp, token_bag
from sparktrain.task.evaluate import finish_metric


def test_label_scaling_is_for_regression_losses():
    assert TrainConfig(loss="mse", label_scaling=True).label_scaling
    with pytest.raises(ConfigError, match="loss='cross_entropy' takes class labels"):
        TrainConfig(label_scaling=True)
    with pytest.raises(ConfigError, match="label_scaling='yes' must be true, false or \"auto\""):
        TrainConfig(loss="mse", label_scaling="yes")
    TrainConfig(loss=torch.nn.functional.l1_loss, label_scaling=True)  # a callable: the user's


def test_the_wrapper_returns_label_units_and_saves_its_figures():
    torch.manual_seed(0)
    inner = mlp(3, (4,), 1)
    scaled = LabelScaled(inner, label_mean=150.0, label_std=70.0)
    x = torch.randn(5, 3)
    assert torch.allclose(scaled(x), inner(x) * 70.0 + 150.0)
    state = scaled.state_dict()
    assert float(state["label_mean"]) == 150.0 and float(state["label_std"]) == 70.0
    assert {k for k in state if k.startswith("inner.")} == {
        f"inner.{k}" for k in inner.state_dict()
    }
    again = LabelScaled(mlp(3, (4,), 1), 0.0, 1.0)
    again.load_state_dict(state)
    assert torch.equal(again(x), scaled(x))
    # masks reach the wrapped model's forward() as they reach the model itself
    names, var_kw = forward_params(LabelScaled(token_bag(), 0.0, 1.0))
    assert "tokens_mask" in names and not var_kw


def test_rmse_is_reported_in_label_units():
    assert finish_metric(4.0, 1.0, "mse") == 2.0
    assert finish_metric(4.0, 1.0, "mse", label_scale=70.0) == 140.0
    assert finish_metric(3.0, 4.0, "cross_entropy", label_scale=70.0) == 0.75  # accuracy
    assert math.isnan(finish_metric(0.0, 0.0, "mse", 70.0))
