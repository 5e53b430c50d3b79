from pathlib import Path

import pytest

from sparktrain.cli import split_job_keys
from sparktrain.config import TrainConfig, apply_overrides, load_toml
from sparktrain.errors import ConfigError, SparkTrainError


def test_defaults_validate():
    cfg = TrainConfig()
    assert cfg.strategy == "ring" and cfg.num_workers == 2


@pytest.mark.parametrize(
    ("key", "value", "needle"),
    [
        (
            "strategy",
            "carrier-pigeon",
            "registered strategies: ring, tree, auto, ps, tree_aggregate",
        ),
        ("ps_mode", "eventual", "allowed values: sync, async, ssp"),
        ("local_steps", 0, "local_steps=0 must be an integer >= 1"),
        ("epochs", 0, "epochs=0 must be an integer >= 1"),
        ("lr", -1.0, "lr=-1.0 must be a number > 0"),
        ("optimizer", "lbfgs", "allowed values: sgd, adam, adamw"),
        ("loss", "hinge", "allowed values: cross_entropy, mse, bce_with_logits"),
        ("validation_fraction", 1.5, "validation_fraction"),
        ("compression", "zip", "allowed values: none"),
    ],
)
def test_bad_values_name_the_key_and_the_allowed_values(key, value, needle):
    with pytest.raises(ConfigError, match=needle):
        TrainConfig.from_dict({key: value})


def test_unknown_key_lists_allowed_keys():
    with pytest.raises(ConfigError, match=r"unknown config key 'epoch'.*epochs"):
        TrainConfig.from_dict({"epoch": 3})


def test_overrides_are_parsed_as_toml_values():
    values = apply_overrides(
        {"epochs": 1},
        ["epochs=3", "lr=0.5", "strategy=tree", "shuffle=false", "optimizer_kwargs={momentum=0.9}"],
    )
    cfg = TrainConfig.from_dict(values)
    assert (cfg.epochs, cfg.lr, cfg.strategy, cfg.shuffle) == (3, 0.5, "tree", False)
    assert cfg.optimizer_kwargs == {"momentum": 0.9}


def test_type_errors_say_what_was_expected():
    with pytest.raises(ConfigError, match="'epochs' expects int"):
        TrainConfig.from_dict(apply_overrides({}, ["epochs=many"]))
    with pytest.raises(ConfigError, match="--set expects key=value"):
        apply_overrides({}, ["epochs"])


def test_int_is_accepted_for_float_keys():
    assert TrainConfig.from_dict({"lr": 1}).lr == 1.0


def test_shipped_configs_load(tmp_path):
    for name in sorted(str(p) for p in Path("conf").glob("*.toml")):
        job, rest = split_job_keys(load_toml(name))
        TrainConfig.from_dict(rest)
        assert ":" in job["model"]


def test_job_table_rejects_unknown_keys():
    with pytest.raises(SparkTrainError, match="the \\[job\\] table takes"):
        split_job_keys({"job.modle": "x"})


def test_missing_or_broken_toml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_toml(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("epochs = = 3")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_toml(bad)


def test_table_keys_are_dotted():
    cfg = TrainConfig.from_dict(
        apply_overrides({"parallelism": {"data": 1}}, ["parallelism.pipeline=2"])
    )
    assert (cfg.parallelism_pipeline, cfg.parallelism_data) == (2, 1)
    assert "parallelism.pipeline" in TrainConfig.allowed_keys()
    with pytest.raises(ConfigError, match="parallelism.pipeline=0 must be an integer >= 1"):
        TrainConfig.from_dict({"parallelism.pipeline": 0})
    with pytest.raises(ConfigError, match="unknown config key 'parallelism.tensor'"):
        TrainConfig.from_dict({"parallelism.tensor": 2})


def test_column_option_tables_come_from_toml_and_set_whole(tmp_path: Path):
    path = tmp_path / "typed.toml"
    path.write_text(
        "feature_shapes = {image = [1, 28, 28], tokens = [-1]}\n"
        'feature_dtypes = {x = "float64"}\n'
        '[decode]\nimage = "mypkg.io:decode_png"\n'
    )
    cfg = TrainConfig.from_toml(path, ['collate={tokens="mypkg.io:pack"}', "shuffle_window=4096"])
    assert cfg.feature_shapes == {"image": [1, 28, 28], "tokens": [-1]}
    assert cfg.feature_dtypes == {"x": "float64"}
    assert cfg.decode == {"image": "mypkg.io:decode_png"}
    assert cfg.collate == {"tokens": "mypkg.io:pack"}
    assert cfg.shuffle_window == 4096
    # callables from Python, shown by name in the JSON view
    cfg = TrainConfig(decode={"image": test_defaults_validate})
    assert cfg.to_dict()["decode"] == {"image": f"{__name__}:test_defaults_validate"}


@pytest.mark.parametrize(
    ("key", "value", "needle"),
    [
        ("feature_shapes", {"image": [1, 0, 28]}, "sizes must be positive"),
        ("feature_shapes", {"tokens": [-1, 4]}, r"only one-dimensional variable-length"),
        ("feature_shapes", {"image": "1x28x28"}, "list of sizes"),
        ("feature_dtypes", {"x": "int32"}, "allowed: float32, float64"),
        ("decode", {"image": "decode_png"}, "'package.module:function'"),
        ("collate", ["tokens"], "table of column -> value"),
        ("shuffle_window", -1, "shuffle_window=-1 must be an integer >= 0"),
    ],
)
def test_column_options_are_checked_by_key(key, value, needle):
    with pytest.raises(ConfigError, match=needle):
        TrainConfig(**{key: value})
