"""The allowlist a saved model's modelFn must pass before anything is imported (no Spark
here; tests/integration/test_model_loading.py loads real saved models)."""

from __future__ import annotations

import sys

import pytest

from sparktrain.errors import ConfigError
from sparktrain.ml import allowlist
from sparktrain.ml.allowlist import (
    allow_model_modules,
    allowed_model_modules,
    check_saved_model_fn,
    conf_prefixes,
    module_allowed,
)

HOSTILE = "tests.unit.hostile_models"
HINT = "TorchClassificationModel.load(path, model_fn='package.module:function')"


@pytest.fixture(autouse=True)
def _fresh_registry(monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setattr(allowlist, "_REGISTERED", [])


def _check(model_fn: str, allowed: tuple[str, ...] | None = None):  # type: ignore[no-untyped-def]
    allowed = allowed_model_modules() if allowed is None else allowed
    return check_saved_model_fn(model_fn, allowed, source="/models/m", override_hint=HINT)


@pytest.mark.parametrize(
    "model_fn", ["builtins:print", "os:system", "subprocess:run", f"{HOSTILE}:net"]
)
def test_a_module_outside_the_allowlist_is_refused_before_it_is_imported(model_fn):
    with pytest.raises(ConfigError) as err:
        _check(model_fn)
    text = str(err.value)
    module = model_fn.partition(":")[0]
    assert f"refusing to load /models/m: its modelFn {model_fn!r} is in module {module!r}" in text
    assert f"sparktrain.ml.allow_model_modules({module!r})" in text
    assert "spark.sparktrain.allowedModelModules" in text and HINT in text
    assert HOSTILE not in sys.modules  # refused before import: its code never ran


@pytest.mark.parametrize(
    ("model_fn", "why"),
    [
        ("sparktrain.models:nn.Linear", "reaches into module 'torch.nn'"),
        ("sparktrain.models:pairwise", "'pairwise' is defined in 'itertools'"),
        ("sparktrain.models:mlp.__call__", "public function"),
        ("sparktrain.models:_private", "public function"),
        ("sparktrain.modelsevil:net", "is in module 'sparktrain.modelsevil'"),
        ("sparktrain:models.mlp", "is in module 'sparktrain'"),
        ("sparktrain.models.mlp", "public function"),
        (":print", "public function"),
        ("..models:mlp", "public function"),
    ],
)
def test_names_that_escape_the_allowed_module_are_refused(model_fn, why):
    with pytest.raises(ConfigError, match="refusing to load") as err:
        _check(model_fn)
    assert why in str(err.value)


def test_the_default_allows_sparktrains_own_factories():
    from sparktrain import models

    assert allowed_model_modules() == ("sparktrain.models",)
    assert _check("sparktrain.models:digits_mlp") is models.digits_mlp
    assert _check("sparktrain.models:mlp") is models.mlp


def test_a_registered_module_is_allowed_and_only_its_own_definitions():
    with pytest.raises(ConfigError, match="tests.unit.user_models"):
        _check("tests.unit.user_models:tiny")
    allow_model_modules("tests.unit.user_models")
    allow_model_modules("tests.unit.user_models")  # idempotent
    assert allowed_model_modules() == ("sparktrain.models", "tests.unit.user_models")
    from tests.unit import user_models

    assert _check("tests.unit.user_models:tiny") is user_models.tiny
    with pytest.raises(ConfigError, match="'OrderedDict' is defined in 'collections'"):
        _check("tests.unit.user_models:OrderedDict")  # imported there, not defined


def test_prefixes_match_whole_dotted_components():
    assert module_allowed("mypkg", ["mypkg"]) and module_allowed("mypkg.models.cnn", ["mypkg"])
    assert not module_allowed("mypkgevil", ["mypkg"])
    assert not module_allowed("mypkgevil.models", ["mypkg"])
    assert not module_allowed("my", ["mypkg"])


@pytest.mark.parametrize("bad", ["", "mypkg:net", "*", "my pkg", "mypkg.", ".mypkg", 3])
def test_allow_model_modules_takes_module_names_only(bad):
    with pytest.raises(ConfigError, match="allow_model_modules"):
        allow_model_modules(bad)
    assert allowed_model_modules() == ("sparktrain.models",)


def test_the_spark_conf_value_is_a_comma_separated_list_of_prefixes():
    assert conf_prefixes(None) == () and conf_prefixes(" ") == ()
    assert conf_prefixes("a.b, c ,") == ("a.b", "c")
    with pytest.raises(ConfigError, match="spark.sparktrain.allowedModelModules"):
        conf_prefixes("a:b")
    assert allowed_model_modules(("a.b",)) == ("sparktrain.models", "a.b")
