"""Every config error that tells the user to set a key to a value (issue 34.4): the fix,
copied from the message as written, makes the config pass. One row per message, named
after where the message comes from.

A fix is applied the way the message implies: after ``--set`` (through
:func:`~sparktrain.config.apply_overrides` and :meth:`TrainConfig.from_dict`, the road of a
TOML file and the CLI) or, for the messages only Python can reach (a value of a type
``from_dict`` refuses before the check), as keyword arguments of ``TrainConfig``. A
value-only suggestion ("e.g. 512") is for the key the message names. No Spark."""

from __future__ import annotations

import ast
import logging
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest

from sparktrain.comm_backend import check_torch_transport
from sparktrain.compress.registry import build
from sparktrain.config import (
    TrainConfig,
    apply_overrides,
    changed_defaults_notice,
    single_spec,
)
from sparktrain.driver.job import check_job
from sparktrain.driver.resources import check_can_launch, check_transport_security
from sparktrain.driver.spark_env import ClassicEnv
from sparktrain.errors import ConfigError, SparkTrainError
from sparktrain.parallel.pipeline import layout
from sparktrain.strategies import registry

# What a user copies: ``key=value`` (spaces around ``=`` allowed), the value a quoted
# string, an inline table or list, or a bare word up to the next space, comma, semicolon
# or closing parenthesis.
VALUE = r"""(?:'[^']*'|"[^"]*"|\{[^{}]*\}|\[[^\]]*\]|[^\s,;)]+)"""
PAIR = rf"[A-Za-z_][\w.]*\s?=\s?{VALUE}"


# ------------------------------------------------------------------ the checks beyond building
def fit(cfg: TrainConfig) -> None:
    check_job(cfg, "fit")


def run(cfg: TrainConfig) -> None:
    check_job(cfg, "run")


def warns(check: Callable[[TrainConfig], object]) -> Callable[[TrainConfig], None]:
    """``check``, with a warning sparktrain logs raised as an error."""

    def checked(cfg: TrainConfig) -> None:
        with _logged() as records:
            check(cfg)
        if records:
            raise ConfigError(records[0].getMessage())

    return checked


@contextmanager
def _logged() -> Iterator[list[logging.LogRecord]]:
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                records.append(record)

    logger, handler = logging.getLogger("sparktrain"), Keep()
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def notice(cfg: TrainConfig) -> None:
    """The changed-defaults notice a fit logs once, as an error."""
    if text := changed_defaults_notice(cfg):
        raise ConfigError(text)


def lr_notice(cfg: TrainConfig) -> None:
    """Its first sentence: a rate given for the old default optimizer."""
    if (text := changed_defaults_notice(cfg)).startswith("lr="):
        raise ConfigError(text)


def single(cfg: TrainConfig) -> None:
    single_spec(cfg.compression, "ps")


def torch_run_transport(*enabled: str) -> Callable[[TrainConfig], None]:
    def checked(cfg: TrainConfig) -> None:
        check_torch_transport(list(enabled), cfg, "torch_run")

    return checked


class _Conf(dict[str, str]):
    def get(self, key: str, default: str | None = None) -> str | None:  # type: ignore[override]
        return super().get(key, default)


class _Context:
    master = "local[2]"

    def __init__(self, **conf: str) -> None:
        self.conf = _Conf(conf)

    def getConf(self) -> _Conf:
        return self.conf


def _env(**conf: str) -> ClassicEnv:
    return ClassicEnv(_Context(**conf))  # type: ignore[arg-type]


def encryption_gate(cfg: TrainConfig) -> None:
    check_transport_security(_env(**{"spark.network.crypto.enabled": "true"}), cfg)


def launch_gate(cfg: TrainConfig) -> None:
    """``open_job``'s slot check, which only a barrier stage or a pipeline asks."""
    if registry.get(cfg.strategy).launcher == "barrier" or cfg.parallelism_pipeline > 1:
        check_can_launch(_env(**{"spark.dynamicAllocation.enabled": "true"}), 2)


# ------------------------------------------------------------------ the messages
SET = ("set",)
PYTHON = ("python",)


@dataclass(frozen=True)
class Case:
    given: dict[str, Any]
    """The config that errs (``--set``/TOML keys, or Python keywords)."""
    lead: str
    """The words just before the fix in the message."""
    check: Callable[[TrainConfig], object] | None = None
    """Beyond building the config (``check_job``, a warning, a gate)."""
    key: str | None = None
    """The key a value-only suggestion is for."""
    ways: tuple[str, ...] = ("set", "python")
    """How the fix must work: after ``--set``, as Python keyword arguments, or both.
    ``true``/``false`` and dotted keys are ``--set`` and TOML; a message only Python
    reaches (a value ``from_dict`` refuses before the check) must work there."""
    drop: tuple[str, ...] = ()
    """Keys the fix stands in for (a dotted entry the whole table replaces)."""


CASES = {
    # ---------------------------------------------------------------- config.py
    "config.data_memory_mb": Case({"data_memory_mb": -1}, "e.g. ", key="data_memory_mb"),
    "config.validation_fraction": Case(
        {"validation_fraction": 1.5}, "e.g. ", key="validation_fraction"
    ),
    "config.optimizer_kwargs_table": Case({"optimizer_kwargs": "fast"}, "e.g. ", ways=PYTHON),
    "config.loss_kwargs_table": Case({"loss_kwargs": "smooth"}, "e.g. ", ways=PYTHON),
    "config.label_scaling_classes": Case({"label_scaling": True}, "set ", ways=SET),
    "config.entry_of_a_string": Case(
        {"compression": "int8", "compression.fc1": "fp16"},
        "e.g. ",
        drop=("compression.fc1",),
        ways=SET,
    ),
    "config.sgd_settings": Case({"optimizer_kwargs": {"momentum": 0.9}}, "set "),
    "config.momentum_clash": Case(
        {
            "compression": "topk:0.01+ef:momentum=0.9",
            "optimizer": "sgd",
            "optimizer_kwargs": {"momentum": 0.9},
        },
        "set ",
        ways=SET,
    ),
    "config.changed_defaults_lr": Case({"lr": 0.1}, "Adam: set ", lr_notice),
    "config.changed_defaults": Case({"loss": "mse"}, "); set ", notice, ways=SET),
    "config.shard_optimizer_compression": Case(
        {"shard_optimizer": True, "compression": "int8"}, "set "
    ),
    "config.shard_optimizer_comm_backend": Case(
        {"shard_optimizer": True, "comm_backend": "torch"}, "needs "
    ),
    "config.shard_optimizer_precision": Case(
        {"shard_optimizer": True, "precision": "fp16"}, "use ", key="precision"
    ),
    "config.shard_optimizer_device": Case({"shard_optimizer": True, "device": "cuda"}, "use "),
    "config.divergence_factor": Case({"divergence_factor": 1}, "e.g. ", key="divergence_factor"),
    "config.metrics_list": Case({"metrics": "accuracy"}, "e.g. ", ways=PYTHON),
    "config.early_stopping_table": Case({"early_stopping": "accuracy"}, "e.g. ", ways=PYTHON),
    "config.early_stopping_metric": Case({"early_stopping": {"patience": 3}}, "e.g. "),
    "config.feature_shapes_table": Case({"feature_shapes": "28x28"}, "e.g. ", ways=PYTHON),
    "config.feature_dtypes_table": Case({"feature_dtypes": "float64"}, "e.g. ", ways=PYTHON),
    "config.decode_table": Case({"decode": "png"}, "e.g. ", ways=PYTHON),
    "config.collate_table": Case({"collate": "pack"}, "e.g. ", ways=PYTHON),
    "config.decode_hook": Case({"decode": {"image": "decode_png"}}, "e.g. "),
    "config.lr_schedule_kwargs_table": Case({"lr_schedule_kwargs": "cosine"}, "e.g. ", ways=PYTHON),
    "config.driver_services_ports": Case(
        {"driver_services_ports": "80"}, "e.g. ", key="driver_services_ports"
    ),
    "config.driver_services_host": Case(
        {"driver_services_host": "0.0.0.0"}, "wildcard), or ", key="driver_services_host"
    ),
    "config.compression_empty_table": Case({"compression": {}}, "e.g. "),
    "config.compression_not_a_string": Case(
        {"compression": 5}, "such as ", key="compression", ways=PYTHON
    ),
    "config.single_spec": Case({"compression": {"*": "int8+ef"}}, "e.g. ", single),
    # ---------------------------------------------------------------- comm_backend.py
    "comm_backend.encryption": Case({"comm_backend": "torch", "encryption": "tls"}, "(use "),
    "comm_backend.no_ddp_hook": Case({"comm_backend": "torch", "compression": "int8"}, ", or "),
    "comm_backend.torch_run_encryption": Case(
        {"encryption": "tls"}, "or set ", torch_run_transport()
    ),
    "comm_backend.torch_run_spark_encrypts": Case(
        {}, "or set ", torch_run_transport("spark.network.crypto.enabled"), ways=SET
    ),
    # ---------------------------------------------------------------- driver/job.py check_job
    "job.run_pipeline": Case({"parallelism.pipeline": 2}, "(set ", run, ways=SET),
    "job.run_compression_auto": Case({"compression": "auto"}, "(e.g. ", run, key="compression"),
    # ---------------------------------------------------------------- strategies/base.py
    "base.pipeline_compression_auto": Case(
        {"parallelism.pipeline": 2, "compression": "auto"}, "e.g. ", fit
    ),
    "base.pipeline_compression_auto_none": Case(
        {"parallelism.pipeline": 2, "compression": "auto"}, "', or ", fit
    ),
    "base.compression_auto_compressor": Case(
        {"strategy": "ps", "compression": "auto"}, "(e.g. ", fit, key="compression"
    ),
    "base.compression_auto_strategy": Case(
        {"strategy": "ps", "compression": "auto"}, "or use ", fit
    ),
    "base.per_layer_table": Case({"strategy": "ps", "compression": {"*": "int8+ef"}}, "e.g. ", fit),
    "base.delta_on_fresh_gradients": Case(
        {"compression": "delta+int8"}, "(e.g. use ", fit, key="compression"
    ),
    "base.sign_short_batch_warning": Case({"compression": "sign+ef"}, "set ", warns(fit), ways=SET),
    "base.pipeline_strategy": Case({"strategy": "ps", "parallelism.pipeline": 2}, "use ", fit),
    "base.loop_options_rounds": Case(
        {"strategy": "tree_aggregate", "clip_grad_norm": 1.0}, "use ", fit
    ),
    "base.loop_options_pipeline": Case(
        {"parallelism.pipeline": 2, "clip_grad_norm": 1.0}, "set ", fit, ways=SET
    ),
    "base.cuda": Case({"strategy": "ps", "device": "cuda"}, "use ", fit),
    "base.shard_optimizer": Case({"strategy": "ps", "shard_optimizer": True}, "needs ", fit),
    "base.comm_backend_torch": Case(
        {"strategy": "ps", "comm_backend": "torch"}, "gradients of ", fit
    ),
    "base.compression_path_strategy": Case(
        {"strategy": "ps", "compression": "fp16", "compression_path": "reduce"}, "leave ", fit
    ),
    "base.compression_path_leave_auto": Case({"compression_path": "reduce"}, "or leave ", fit),
    **{
        f"base.compression_path_needs_spec_{path}": Case({"compression_path": path}, "e.g. ", fit)
        # resparsify_tree ("topk:0.01+ef") too once the ring's doubling rounds are in
        for path in ("reduce", "allgather", "recompress", "resparsify")
    },
    # ---------------------------------------------------------------- compress/collective.py
    "collective.path_does_not_apply": Case(
        {"compression": "int8", "compression_path": "resparsify"},
        "the paths that do: ",
        fit,
        key="compression_path",
    ),
    # ---------------------------------------------------------------- strategies/allreduce
    "allreduce.auto_pipeline": Case({"strategy": "auto", "parallelism.pipeline": 2}, "give ", fit),
    # ---------------------------------------------------------------- strategies/ps
    "ps.server_side_options": Case({"strategy": "ps", "clip_grad_norm": 1.0}, "use ", fit),
    "ps.protocol_delta_powersgd": Case(
        {"strategy": "ps", "compression": "delta+powersgd:2"},
        "; use ",
        fit,
        key="compression",
        ways=SET,
    ),
    # ---------------------------------------------------------------- strategies/tree_aggregate
    "tree_aggregate.codec_delta_powersgd": Case(
        {"strategy": "tree_aggregate", "compression": "delta+powersgd:2"},
        "; use ",
        fit,
        key="compression",
        ways=SET,
    ),
    # ---------------------------------------------------------------- strategies/registry.py
    "registry.did_you_mean": Case({"strategy": "rign"}, "Did you mean ", key="strategy", ways=SET),
    # ---------------------------------------------------------------- compress/spec.py
    "spec.needs_ratio": Case({"compression": "topk+ef"}, "e.g. ", key="compression", ways=SET),
    # ---------------------------------------------------------------- parallel/pipeline.py
    "pipeline.layout": Case(
        {"parallelism.pipeline": 2, "parallelism.data": 3, "num_workers": 4}, "(e.g. ", layout
    ),
    # ---------------------------------------------------------------- driver/resources.py
    "resources.encryption_gate_tls": Case({}, "Set ", encryption_gate),
    "resources.encryption_gate_allow": Case({}, "(or ", encryption_gate, ways=SET),
    "resources.dynamic_allocation": Case({}, "or use ", launch_gate),
}


def keywords(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` as ``TrainConfig`` keywords (``parallelism.pipeline``:
    ``parallelism_pipeline``)."""
    return {k.replace(".", "_"): v for k, v in values.items()}


def accepted(values: dict[str, Any], case: Case, way: str) -> TrainConfig:
    """The config ``values`` build the ``way`` in, checked as ``case`` says."""
    cfg = TrainConfig(**keywords(values)) if way == "python" else TrainConfig.from_dict(values)
    if case.check is not None:
        case.check(cfg)
    return cfg


def suggested(message: str, case: Case) -> list[str]:
    """The ``key=value`` fix(es) right after ``case.lead``, as a user copies them:
    ``a=1, b=2`` is two."""
    at = message.find(case.lead)
    assert at >= 0, f"{case.lead!r} not in {message!r}"
    rest = message[at + len(case.lead) :]
    if case.key is not None:
        value = re.match(VALUE, rest)
        assert value, rest
        return [f"{case.key}={value.group().rstrip(':')}"]
    fix = re.match(rf"{PAIR}(?:, {PAIR})*", rest)
    assert fix, f"no key=value after {case.lead!r} in {message!r}"
    return re.findall(PAIR, fix.group())


def as_keywords(pairs: list[str]) -> dict[str, Any]:
    """``pairs`` as Python keyword arguments (a syntax error if they are not)."""
    call = ast.parse(f"f({', '.join(pairs)})", mode="eval").body
    assert isinstance(call, ast.Call)
    return {str(k.arg): ast.literal_eval(k.value) for k in call.keywords}


@pytest.mark.parametrize("case", [pytest.param(c, id=i) for i, c in CASES.items()])
def test_the_suggested_fix_works_as_written(case: Case) -> None:
    kept = {k: v for k, v in case.given.items() if k not in case.drop}
    for way in case.ways:
        with pytest.raises(SparkTrainError) as err:
            accepted(case.given, case, way)
        pairs = suggested(str(err.value), case)
        if way == "python":
            accepted({**kept, **as_keywords(pairs)}, case, way)
        else:
            accepted(apply_overrides(kept, pairs), case, way)


# ------------------------------------------------------------------ inside a compression spec
@pytest.mark.parametrize(
    ("spec", "lead", "fixed"),
    [
        # compress/spec.py: an error-feedback option before +ef moves behind it
        pytest.param(
            "topk:0.01,momentum=0.9",
            "e.g. ",
            lambda spec, fix: spec.replace(",momentum=0.9", "") + fix,
            id="spec.ef_option_before_ef",
        ),
        # compress/feedback.py: mask= needs momentum=M among the +ef options
        pytest.param(
            "topk:0.01+ef:mask=1",
            "add ",
            lambda spec, fix: f"{spec},{fix}",
            id="feedback.mask_without_momentum",
        ),
    ],
)
def test_the_suggested_spec_fix_works_as_written(
    spec: str, lead: str, fixed: Callable[[str, str], str]
) -> None:
    with pytest.raises(ConfigError) as err:
        build(spec)
    message = str(err.value)
    at = message.find(lead)
    assert at >= 0, message
    fix = re.match(r"[^\s;,)]+", message[at + len(lead) :])
    assert fix, message
    assert build(fixed(spec, fix.group())) is not None


# ------------------------------------------------------------------ as an estimator's param
def test_the_params_early_stopping_fix_works_as_written() -> None:
    """ml/paramgen: TrainConfig's message, with the param's name for the key's, also in
    the example, which pastes as the estimator's keyword argument."""
    from sparktrain.ml import TorchClassifier

    with pytest.raises(ValueError, match="earlyStopping needs the metric") as err:
        TorchClassifier(earlyStopping={"patience": 3})
    pairs = suggested(str(err.value), Case({}, "e.g. "))
    assert pairs == ['earlyStopping={"metric": "accuracy"}']
    assert TorchClassifier(**as_keywords(pairs)).getEarlyStopping() == '{"metric": "accuracy"}'
