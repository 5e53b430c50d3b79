"""Turning config names into torch objects: model factories, losses, optimizers.

Shared by the driver (which builds everything once to validate the job before any Spark
stage starts) and the workers (which build the same objects for real).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from sparktrain.errors import ConfigError

ModelFn = Callable[[], nn.Module] | str
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def resolve_model_fn(
    model_fn: ModelFn, kwargs: dict[str, Any] | None = None
) -> Callable[[], nn.Module]:
    """Accept a zero-argument callable or an importable ``"package.module:function"``."""
    if isinstance(model_fn, str):
        fn = import_callable(model_fn, what="model_fn")
    elif callable(model_fn):
        fn = model_fn
    else:
        raise ConfigError(
            f"model_fn must be a callable or a 'package.module:function' string, got {model_fn!r}"
        )
    if kwargs:
        return lambda: fn(**kwargs)
    return fn


def import_callable(path: str, what: str = "callable") -> Callable[..., Any]:
    """Import ``"package.module:attr"`` and check that it is callable."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{what} {path!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"{what} {path!r}: cannot import module {module_name!r} ({exc}); is it installed "
            "on the driver and the executors (or shipped with --py-files)?"
        ) from exc
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"{what} {path!r}: module {module_name!r} has no attribute {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(f"{what} {path!r} is not callable")
    return target


def build_model(model_fn: Callable[[], nn.Module]) -> nn.Module:
    """Call the factory and check that it returned a module with parameters."""
    model = model_fn()
    if isinstance(model, list | tuple) and model and all(isinstance(m, nn.Module) for m in model):
        model = nn.Sequential(*model)  # a list of pipeline stages
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model_fn returned {type(model).__name__}, expected a torch.nn.Module")
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError("model_fn returned a module without trainable parameters")
    return model


_LOSSES: dict[str, type[nn.Module]] = {
    "cross_entropy": nn.CrossEntropyLoss,
    "mse": nn.MSELoss,
    "bce_with_logits": nn.BCEWithLogitsLoss,
}


def build_loss(loss: str | LossFn, kwargs: dict[str, Any]) -> LossFn:
    """A mean-reduced loss: by name with keyword arguments, or the user's callable."""
    if callable(loss):
        return loss
    try:
        return _LOSSES[loss](**kwargs)
    except KeyError:
        raise ConfigError(f"loss={loss!r} unknown; allowed: {', '.join(_LOSSES)}") from None
    except TypeError as exc:
        raise ConfigError(f"loss_kwargs {kwargs} do not fit loss {loss!r}: {exc}") from exc


def is_classification(loss: str | LossFn) -> bool:
    """Classification losses report accuracy; the rest report RMSE."""
    return loss in ("cross_entropy", "bce_with_logits")


def label_dtype(loss: str | LossFn) -> torch.dtype:
    """Class indices for cross entropy, floats for everything else."""
    return torch.int64 if loss == "cross_entropy" else torch.float32


def build_optimizer(
    name: str | Callable[..., torch.optim.Optimizer],
    params: Iterable[nn.Parameter],
    lr: float,
    kwargs: dict[str, Any],
) -> torch.optim.Optimizer:
    """``sgd`` / ``adam`` / ``adamw`` with keyword arguments, or ``callable(params, lr)``."""
    if callable(name):
        factory: Callable[..., torch.optim.Optimizer] = name
        return factory(params, lr=lr, **kwargs)
    classes: dict[str, Any] = {
        "sgd": torch.optim.SGD,
        "adam": torch.optim.Adam,
        "adamw": torch.optim.AdamW,
    }
    if name not in classes:
        raise ConfigError(f"optimizer={name!r} unknown; allowed: {', '.join(classes)}")
    try:
        optimizer: torch.optim.Optimizer = classes[name](params, lr=lr, **kwargs)
        return optimizer
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"optimizer_kwargs {kwargs} do not fit optimizer {name!r}: {exc}"
        ) from exc
