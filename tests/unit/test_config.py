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
        ("optimizer", "lbfgs", "allowed values: sgd, adam, adamw, adagrad, sparse_adam"),
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
        [
            "epochs=3",
            "lr=0.5",
            "strategy=tree",
            "shuffle=false",
            "optimizer=sgd",
            "optimizer_kwargs={momentum=0.9}",
        ],
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


# ---------------------------------------------------------------------- the loop's keys
LOOP_TOML = """\
lr_schedule = "CosineAnnealingLR"
lr_schedule_kwargs = {T_max = 100}
lr_schedule_interval = "epoch"
warmup_steps = 50
precision = "bf16"
fp16_skip_limit = 5
accumulate_steps = 4
clip_grad_norm = 1
metrics = ["macro_f1", "top_k:3"]
tensorboard_dir = "runs/digits"
mlflow_tracking_uri = "file:///tmp/mlruns"
mlflow_experiment = "digits"

[early_stopping]
metric = "accuracy"
patience = 3
"""


def test_loop_keys_come_from_toml(tmp_path: Path):
    path = tmp_path / "loop.toml"
    path.write_text(LOOP_TOML)
    cfg = TrainConfig.from_toml(path)
    assert (cfg.lr_schedule, cfg.lr_schedule_kwargs, cfg.lr_schedule_interval) == (
        "CosineAnnealingLR",
        {"T_max": 100},
        "epoch",
    )
    assert (cfg.warmup_steps, cfg.precision, cfg.fp16_skip_limit) == (50, "bf16", 5)
    assert cfg.accumulate_steps == 4
    assert cfg.clip_grad_norm == 1.0 and isinstance(cfg.clip_grad_norm, float)
    # a [early_stopping] table stays one table (it is not flattened into dotted keys)
    assert cfg.early_stopping == {"metric": "accuracy", "patience": 3}
    assert cfg.metrics == ["macro_f1", "top_k:3"]
    assert (cfg.tensorboard_dir, cfg.mlflow_tracking_uri, cfg.mlflow_experiment) == (
        "runs/digits",
        "file:///tmp/mlruns",
        "digits",
    )
    # the JSON view (summaries, MLflow parameters) shows them as read
    view = cfg.to_dict()
    assert view["early_stopping"] == {"metric": "accuracy", "patience": 3}
    assert view["metrics"] == ["macro_f1", "top_k:3"]


def test_loop_keys_default_to_a_plain_loop():
    cfg = TrainConfig()
    assert (cfg.lr_schedule, cfg.lr_schedule_kwargs, cfg.warmup_steps) == ("none", {}, 0)
    assert (cfg.precision, cfg.accumulate_steps, cfg.clip_grad_norm) == ("fp32", 1, 0.0)
    assert (cfg.early_stopping, cfg.metrics) == ({}, [])
    assert (cfg.tensorboard_dir, cfg.mlflow_tracking_uri) == ("", "")


def test_loop_keys_come_from_set_overrides(tmp_path: Path):
    path = tmp_path / "loop.toml"
    path.write_text(LOOP_TOML)
    cfg = TrainConfig.from_toml(
        path,
        [
            "lr_schedule=StepLR",  # a bare word is a string
            "lr_schedule_kwargs={step_size = 10, gamma = 0.5}",
            "lr_schedule_interval=step",
            "warmup_steps=0",
            "precision=fp16",
            "fp16_skip_limit=20",
            "accumulate_steps=2",
            "clip_grad_norm=0.5",
            'early_stopping={metric = "loss", min_delta = 0.01, restore_best = true}',
            'metrics=["auc", "log_loss"]',
            "tensorboard_dir=/tmp/tb",
            'mlflow_tracking_uri="http://mlflow:5000"',
            "mlflow_experiment=exp",
        ],
    )
    assert (cfg.lr_schedule, cfg.lr_schedule_kwargs) == ("StepLR", {"step_size": 10, "gamma": 0.5})
    assert (cfg.lr_schedule_interval, cfg.warmup_steps) == ("step", 0)
    assert (cfg.precision, cfg.fp16_skip_limit, cfg.accumulate_steps) == ("fp16", 20, 2)
    assert cfg.clip_grad_norm == 0.5
    # --set gives the whole table: the file's patience is gone, not merged
    assert cfg.early_stopping == {"metric": "loss", "min_delta": 0.01, "restore_best": True}
    assert cfg.metrics == ["auc", "log_loss"]
    assert (cfg.tensorboard_dir, cfg.mlflow_tracking_uri, cfg.mlflow_experiment) == (
        "/tmp/tb",
        "http://mlflow:5000",
        "exp",
    )
    # overrides alone, without a file, and a JSON object for a table
    values = apply_overrides({}, ['early_stopping={"metric": "accuracy", "mode": "max"}'])
    assert TrainConfig.from_dict(values).early_stopping == {"metric": "accuracy", "mode": "max"}
    # from Python, a metric may be a callable
    cfg = TrainConfig(metrics=["accuracy", test_defaults_validate])
    assert cfg.to_dict()["metrics"] == ["accuracy", f"{__name__}:test_defaults_validate"]


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        (
            "lr_schedule=Cosine",
            r"lr_schedule='Cosine' is not a torch.optim.lr_scheduler class; use 'none' or one "
            r"of .*CosineAnnealingLR, .*OneCycleLR, .*ReduceLROnPlateau, StepLR",
        ),
        ("lr_schedule=SequentialLR", "lr_schedule='SequentialLR' is not a torch.optim"),
        ("lr_schedule_kwargs=[1, 2]", "config key 'lr_schedule_kwargs' expects dict"),
        ("lr_schedule_interval=batch", "allowed values: step, epoch"),
        ("warmup_steps=-1", "warmup_steps=-1 must be an integer >= 0"),
        ("precision=fp8", "precision='fp8' is not supported; allowed values: fp32, bf16, fp16"),
        ("fp16_skip_limit=0", "fp16_skip_limit=0 must be an integer >= 1"),
        ("accumulate_steps=0", "accumulate_steps=0 must be an integer >= 1"),
        ("accumulate_steps=1.5", "config key 'accumulate_steps' expects int"),
        ("clip_grad_norm=-1", r"clip_grad_norm=-1.0 must be a number >= 0 \(0 = no clipping\)"),
        ("clip_grad_norm=nan", "clip_grad_norm=nan must be a number >= 0"),
        (
            'early_stopping={metric = "loss", patiance = 3}',
            r"early_stopping: unknown key\(s\) patiance; allowed: metric, mode, patience, "
            "min_delta, restore_best",
        ),
        ("early_stopping={patience = 3}", "early_stopping needs the metric to watch"),
        ('early_stopping={metric = ""}', "early_stopping needs the metric to watch"),
        ('early_stopping={metric = "loss", mode = "up"}', "mode='up' must be 'min' or 'max'"),
        (
            'early_stopping={metric = "loss", patience = 0}',
            "early_stopping.patience=0 must be an integer >= 1",
        ),
        (
            'early_stopping={metric = "loss", min_delta = -0.1}',
            "early_stopping.min_delta=-0.1 must be a number >= 0",
        ),
        (
            'early_stopping={metric = "loss", restore_best = "yes"}',
            "early_stopping.restore_best must be true or false",
        ),
        ("early_stopping=accuracy", "config key 'early_stopping' expects dict"),
        (
            'metrics=["f1"]',
            r"metrics: 'f1' is not a metric; use one of accuracy, top_k:K, macro_f1, auc",
        ),
        ('metrics=["top_k:0"]', "metrics: 'top_k:0' is not a metric"),
        ('metrics=["top_k:x"]', "metrics: 'top_k:x' is not a metric"),
        ('metrics=["top_k"]', "metrics: 'top_k' is not a metric"),
        ('metrics=["top_k:K"]', "metrics: 'top_k:K' is not a metric"),  # K is a placeholder
        ("metrics=macro_f1", "config key 'metrics' expects list"),
        ("tensorboard_dir=3", None),  # a number is taken as its text: allowed
    ],
)
def test_bad_loop_values_name_the_key_and_what_it_takes(tmp_path: Path, override, needle):
    path = tmp_path / "loop.toml"
    path.write_text(LOOP_TOML)
    if needle is None:
        assert TrainConfig.from_toml(path, [override]).tensorboard_dir == "3"
        return
    with pytest.raises(ConfigError, match=needle):
        TrainConfig.from_toml(path, [override])


def test_bad_loop_values_from_python_get_the_same_errors():
    with pytest.raises(ConfigError, match="metrics: 'f1' is not a metric.*callable"):
        TrainConfig(metrics=["f1"])
    with pytest.raises(ConfigError, match="metrics must be a list"):
        TrainConfig(metrics="macro_f1")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="clip_grad_norm=True must be a number >= 0"):
        TrainConfig(clip_grad_norm=True)
    with pytest.raises(ConfigError, match="early_stopping must be a table"):
        TrainConfig(early_stopping="accuracy")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="mlflow_experiment must be a string"):
        TrainConfig(mlflow_experiment=None)  # type: ignore[arg-type]


def test_dotted_keys_reach_into_dict_valued_settings() -> None:
    """``--set optimizer_kwargs.momentum=0`` is what the momentum-clash error tells a user
    to write: it sets one entry of the table and keeps the others."""
    values = apply_overrides(
        {"optimizer": "sgd", "optimizer_kwargs": {"momentum": 0.9, "nesterov": True}},
        ["optimizer_kwargs.momentum=0", "early_stopping.metric=loss", "early_stopping.patience=3"],
    )
    cfg = TrainConfig.from_dict(values)
    assert cfg.optimizer_kwargs == {"momentum": 0, "nesterov": True}
    assert cfg.early_stopping == {"metric": "loss", "patience": 3}
    nested = TrainConfig.from_dict({"lr_schedule_kwargs.a.b": 1})
    assert nested.lr_schedule_kwargs == {"a": {"b": 1}}
    assert TrainConfig.from_dict({"compression.fc1": "int8"}).compression == {"fc1": "int8"}
    with pytest.raises(ConfigError, match="which is 'fp16', not a table"):
        TrainConfig.from_dict({"compression": "fp16", "compression.fc1": "int8"})
    with pytest.raises(ConfigError, match="unknown config key 'epochs.x'"):
        TrainConfig.from_dict({"epochs.x": 1})


def test_the_momentum_clash_fix_works_as_written() -> None:
    clash = {
        "compression": "topk:0.01+ef:momentum=0.9",
        "optimizer": "sgd",
        "optimizer_kwargs": {"momentum": 0.9},
    }
    with pytest.raises(ConfigError, match="set optimizer_kwargs.momentum=0") as err:
        TrainConfig.from_dict(clash)
    fix = str(err.value).partition("set ")[2].split()[0]  # pasted after --set
    assert TrainConfig.from_dict(apply_overrides(clash, [fix])).optimizer_kwargs == {"momentum": 0}
