"""Turning config names into torch objects: model factories, losses, optimizers.

Shared by the driver (which builds everything once to validate the job before any Spark
stage starts) and the workers (which build the same objects for real).
"""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
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
    if isinstance(model_fn, nn.Module):
        # a module is callable too: calling it with no input fails deep in forward()
        name = type(model_fn).__name__
        raise ConfigError(
            f"model_fn is a {name} instance; pass a factory that builds one: "
            f"model_fn=lambda: {name}(...), a function defined with def, or a "
            "'package.module:function' string. Each worker builds its own copy."
        )
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


class LabelScaled(nn.Module):
    """A regression model trained on standardised labels (``label_scaling``), with its
    outputs brought back to label units: ``inner(...) * label_std + label_mean``.
    ``inner`` is the trained module itself (``state_dict`` keys gain the ``inner.``
    prefix; the two figures are buffers, so they are saved with it)."""

    def __init__(self, inner: nn.Module, label_mean: float, label_std: float) -> None:
        super().__init__()
        self.inner = inner
        self.register_buffer("label_mean", torch.tensor(float(label_mean)))
        self.register_buffer("label_std", torch.tensor(float(label_std)))

    @property
    def forwards_to(self) -> nn.Module:
        """The module whose ``forward()`` arguments (masks) this one takes."""
        return self.inner

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        out: torch.Tensor = self.inner(*args, **kwargs)
        std, mean = self.get_buffer("label_std"), self.get_buffer("label_mean")
        return out * std.to(out.dtype) + mean.to(out.dtype)


class FeatureScaled(nn.Module):
    """A model trained on standardised features (``feature_scaling``) that takes raw
    features again: ``inner((x - feature_mean) / feature_std)``. ``inner`` is the trained
    module itself (``state_dict`` keys gain the ``inner.`` prefix; the figures are
    buffers, so they are saved with it)."""

    def __init__(self, inner: nn.Module, feature_mean: Any, feature_std: Any) -> None:
        super().__init__()
        self.inner = inner
        self.register_buffer("feature_mean", torch.as_tensor(feature_mean, dtype=torch.float64))
        self.register_buffer("feature_std", torch.as_tensor(feature_std, dtype=torch.float64))

    @property
    def forwards_to(self) -> nn.Module:
        """The module whose ``forward()`` arguments this one takes."""
        return self.inner

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        mean, std = self.get_buffer("feature_mean"), self.get_buffer("feature_std")
        scaled = (x - mean.to(x.dtype)) / std.to(x.dtype)
        out: torch.Tensor = self.inner(scaled, *args, **kwargs)
        return out


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

WEIGHTED_LOSS_HELP = (
    "sample weights need one loss per row: use a named loss (cross_entropy, mse, "
    "bce_with_logits), a torch loss module (e.g. torch.nn.HuberLoss()), or a callable with "
    "a `reduction` keyword that returns one loss per row for reduction='none' (as "
    "torch.nn.functional losses do); or drop the weight column"
)


class Loss:
    """A training loss: ``loss(out, target)`` is the mean loss of the batch, exactly the
    configured torch loss; ``loss(out, target, weight)`` is the weighted batch loss
    ``sum_i weight_i * l_i / n`` over the batch's ``n`` rows.

    ``l_i`` is row ``i``'s loss as torch computes it with ``reduction="none"``, averaged
    over any non-batch dimensions (so with all weights 1 the weighted loss equals the mean
    loss of a named loss without class weights). The divisor is ``n``, not the batch's
    weight sum: the driver has divided the weights by their mean over the training data
    (``driver/prepare.py``), which makes the gradient of the whole training set exactly
    that of ``sum w_i l_i / sum w_i`` and keeps the workers' sample-count averaging exact
    (docs/ml.md: "Sample weights"). Loss-specific per-row factors (``CrossEntropyLoss``'s
    class ``weight``, ``BCEWithLogitsLoss``'s ``weight``/``pos_weight``) multiply the
    sample weight; rows skipped by ``ignore_index`` count in ``n`` with loss 0.

    Per-row losses come from a copy of the loss module with ``reduction="none"``, or, for a
    plain callable, from calling it with ``reduction="none"`` (``torch.nn.functional``
    style). A callable without a ``reduction`` keyword cannot be weighted:
    :func:`check_weighted_loss` refuses it on the driver.
    """

    def __init__(self, mean: Callable[..., torch.Tensor], name: str) -> None:
        self.mean = mean
        self.name = name
        self._per_row: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        if isinstance(mean, nn.modules.loss._Loss):
            per_row = copy.copy(mean)  # shares buffers (class weights), not the reduction
            per_row.reduction = "none"
            self._per_row = per_row
        elif _accepts_reduction(mean):
            self._per_row = functools.partial(mean, reduction="none")

    @property
    def supports_weights(self) -> bool:
        """Can this loss give one value per row (and so take sample weights)?"""
        return self._per_row is not None

    def __call__(
        self, out: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None
    ) -> torch.Tensor:
        if weight is None:
            result: torch.Tensor = self.mean(out, target)
            return result
        if self._per_row is None:
            raise ConfigError(f"loss {self.name}: {WEIGHTED_LOSS_HELP}")
        per_row = self._per_row(out, target)
        n = int(weight.shape[0])
        if per_row.ndim == 0 or per_row.shape[0] != n:
            raise ConfigError(
                f"loss {self.name} returned shape {tuple(per_row.shape)} for reduction='none' "
                f"on a batch of {n} rows; {WEIGHTED_LOSS_HELP}"
            )
        if per_row.ndim > 1:
            per_row = per_row.reshape(n, -1).mean(dim=1)
        return (per_row * weight.to(per_row.dtype)).sum() / n


def _accepts_reduction(fn: Callable[..., Any]) -> bool:
    """Does ``fn`` take a ``reduction`` keyword (torch.nn.functional's convention)?"""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins without a signature
        return False
    return "reduction" in params or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()
    )


def build_loss(loss: str | LossFn, kwargs: dict[str, Any]) -> Loss:
    """The training loss (see :class:`Loss`): by name with keyword arguments (mean
    reduction), or the user's callable, which must return the mean loss of a batch."""
    if callable(loss):
        return Loss(loss, getattr(loss, "__name__", type(loss).__name__))
    if loss not in _LOSSES:
        raise ConfigError(f"loss={loss!r} unknown; allowed: {', '.join(_LOSSES)}")
    try:
        return Loss(_LOSSES[loss](**kwargs), repr(loss))
    except TypeError as exc:
        raise ConfigError(f"loss_kwargs {kwargs} do not fit loss {loss!r}: {exc}") from exc


def check_weighted_loss(loss: str | LossFn, kwargs: dict[str, Any]) -> None:
    """On the driver, before any task: can ``loss`` take sample weights? Raises a
    ConfigError that says what to use instead."""
    built = build_loss(loss, kwargs)
    if not built.supports_weights:
        raise ConfigError(f"loss {built.name} cannot take sample weights: {WEIGHTED_LOSS_HELP}")


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
    """``sgd`` / ``adam`` / ``adamw`` / ``adagrad`` / ``sparse_adam`` with keyword
    arguments, or ``callable(params, lr)``."""
    if callable(name):
        factory: Callable[..., torch.optim.Optimizer] = name
        return factory(params, lr=lr, **kwargs)
    cls = _optimizer_class(name)
    try:
        optimizer: torch.optim.Optimizer = cls(params, lr=lr, **kwargs)
        return optimizer
    except (TypeError, ValueError) as exc:
        raise _misfit(name, kwargs, exc) from exc


def check_optimizer(
    name: str | Callable[..., torch.optim.Optimizer],
    params: Iterable[nn.Parameter],
    lr: float,
    kwargs: dict[str, Any],
) -> None:
    """On the driver, before any task: do ``lr`` and ``kwargs`` fit the optimizer? Raises
    the :class:`ConfigError` :func:`build_optimizer` would.

    A built-in optimizer is tried on no parameters: its constructor checks every argument
    and then stops at the empty list, before the first parameter group, whose setup
    imports torch's compiler (some eight hundred modules, seconds to load and to tear
    down at exit) in a driver that never steps. A user's callable is built on
    ``params``."""
    if callable(name):
        build_optimizer(name, params, lr, kwargs)
        return
    cls = _optimizer_class(name)
    try:
        cls([], lr=lr, **kwargs)
    except ValueError as exc:
        if str(exc) == _NO_PARAMETERS:
            return  # every argument passed
        # a bad argument, or another torch's words for the empty list: building decides
        build_optimizer(name, params, lr, kwargs)
    except TypeError as exc:
        raise _misfit(name, kwargs, exc) from exc


_NO_PARAMETERS = "optimizer got an empty parameter list"  # torch.optim.Optimizer's


def _optimizer_class(name: str) -> Callable[..., torch.optim.Optimizer]:
    classes: dict[str, Callable[..., torch.optim.Optimizer]] = {
        "sgd": torch.optim.SGD,
        "adam": torch.optim.Adam,
        "adamw": torch.optim.AdamW,
        "adagrad": torch.optim.Adagrad,
        "sparse_adam": torch.optim.SparseAdam,
    }
    if name not in classes:
        raise ConfigError(f"optimizer={name!r} unknown; allowed: {', '.join(classes)}")
    return classes[name]


def _misfit(name: str, kwargs: dict[str, Any], exc: Exception) -> ConfigError:
    return ConfigError(f"optimizer_kwargs {kwargs} do not fit optimizer {name!r}: {exc}")
