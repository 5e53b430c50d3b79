"""The driver's optimizer check: the errors of building the optimizer, without building
one (a built optimizer's first parameter group imports torch's compiler)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from sparktrain.builders import build_optimizer, check_optimizer
from sparktrain.errors import ConfigError

GOOD = [
    ("sgd", {}),
    ("sgd", {"momentum": 0.9, "nesterov": True}),
    ("adam", {"betas": (0.8, 0.99), "weight_decay": 1e-4}),
    ("adamw", {}),
    ("adagrad", {"lr_decay": 0.01}),
    ("sparse_adam", {}),
]
BAD = [
    ("sgd", {"nesterov": True}, "Nesterov momentum requires a momentum"),
    ("adam", {"betas": (2.0, 0.9)}, "Invalid beta parameter"),
    ("adam", {"bogus": 1}, "unexpected keyword argument 'bogus'"),
    ("adagrad", {"eps": -1.0}, "Invalid epsilon"),
]


@pytest.mark.parametrize(("name", "kwargs"), GOOD)
def test_settings_that_build_pass_the_check(name, kwargs):
    check_optimizer(name, nn.Linear(3, 2).parameters(), 0.01, kwargs)
    build_optimizer(name, nn.Linear(3, 2).parameters(), 0.01, kwargs)


@pytest.mark.parametrize(("name", "kwargs", "why"), BAD)
def test_the_check_raises_what_building_raises(name, kwargs, why):
    with pytest.raises(ConfigError) as checked:
        check_optimizer(name, nn.Linear(3, 2).parameters(), 0.01, kwargs)
    with pytest.raises(ConfigError) as built:
        build_optimizer(name, nn.Linear(3, 2).parameters(), 0.01, kwargs)
    assert str(checked.value) == str(built.value)
    assert why in str(checked.value) and f"optimizer {name!r}" in str(checked.value)


def test_a_torch_that_words_the_empty_list_otherwise_still_passes_good_settings(monkeypatch):
    from sparktrain import builders

    monkeypatch.setattr(builders, "_NO_PARAMETERS", "another torch's message")
    check_optimizer("adam", nn.Linear(3, 2).parameters(), 0.01, {})
    with pytest.raises(ConfigError, match="Invalid beta parameter"):
        check_optimizer("adam", nn.Linear(3, 2).parameters(), 0.01, {"betas": (2.0, 0.9)})


def test_a_negative_learning_rate_and_an_unknown_name_are_refused():
    with pytest.raises(ConfigError, match="Invalid learning rate"):
        check_optimizer("sgd", [], -1.0, {})
    with pytest.raises(ConfigError, match="optimizer='lbfgs' unknown; allowed: sgd, adam"):
        check_optimizer("lbfgs", [], 0.01, {})


def test_a_users_callable_is_built_on_the_parameters():
    seen = []

    def factory(params, lr):
        params = list(params)
        seen.append(len(params))
        if lr > 1:
            raise ValueError("lr too large for this factory")
        return torch.optim.SGD(params, lr=lr)

    check_optimizer(factory, nn.Linear(3, 2).parameters(), 0.1, {})
    assert seen == [2]  # weight and bias
    with pytest.raises(ValueError, match="too large"):
        check_optimizer(factory, nn.Linear(3, 2).parameters(), 2.0, {})


def test_the_check_does_not_import_torchs_compiler():
    """In a fresh interpreter: checking every built-in optimizer leaves torch._dynamo
    unimported (building one imports it)."""
    code = (
        "import sys\n"
        "from torch import nn\n"
        "from sparktrain.builders import build_optimizer, check_optimizer\n"
        "for name in ('sgd', 'adam', 'adamw', 'adagrad', 'sparse_adam'):\n"
        "    check_optimizer(name, nn.Linear(3, 2).parameters(), 0.01, {})\n"
        "checked = 'torch._dynamo' in sys.modules\n"
        "build_optimizer('adam', nn.Linear(3, 2).parameters(), 0.01, {})\n"
        "print(checked, 'torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split() == ["False", "True"]
