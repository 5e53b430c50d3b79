"""Mixed precision for the training loop: autocast, and under fp16 a gradient scaler.

``fp32`` does nothing; ``bf16`` autocasts the forward pass to bfloat16 (its range is
float32's, so no scaling is needed); ``fp16`` autocasts to float16 and scales the loss
with :class:`torch.amp.GradScaler` so small gradients do not flush to zero. Parameters
and optimizer state stay float32 throughout. torch's CPU build runs float16 autocast and
the scaler too, so fp16 is accepted on CPU (slow there; it is meant for CUDA).

Order of calls in one step::

    with precision.autocast():
        loss = loss_fn(model(x), y)
    precision.scale(loss).backward()
    ... average the gradients across ranks ...
    precision.unscale_(optimizer)      # before clipping
    ... clip ...
    stepped = precision.step(optimizer)

Note for callers: gradients are averaged across ranks while still scaled. Averaging is
linear, so the average of scaled gradients is the scaled average; and every rank holds the
same scale, because the scaler's update depends only on whether the averaged gradients
are finite, which is the same on every rank. So :meth:`Precision.unscale_` and
:meth:`Precision.step` come after the exchange, and every rank skips the same steps. A
rank's non-finite loss reaches its peers as non-finite averaged gradients, so they skip
that step too; the stop decision of :meth:`Precision.loss_is_finite`, though, is per rank
and the loop must agree on it across ranks.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from typing import Any

import torch

from sparktrain.errors import ConfigError

_DTYPES: dict[str, torch.dtype | None] = {
    "fp32": None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


class Precision:
    """Autocast, loss scaling and the scaler's bookkeeping for one rank's loop.

    ``skip_limit`` (the config's ``fp16_skip_limit``) is how many consecutive non-finite
    losses fp16 tolerates (the scaler skips those steps) before the run must stop.
    """

    def __init__(self, precision: str, device: torch.device, *, skip_limit: int = 10) -> None:
        if precision not in _DTYPES:
            raise ConfigError(
                f"precision={precision!r} is not supported; allowed values: {', '.join(_DTYPES)}"
            )
        if skip_limit < 1:
            raise ConfigError(f"fp16_skip_limit={skip_limit!r} must be an integer >= 1")
        self.precision = precision
        self.device = device
        self.skip_limit = skip_limit
        self.dtype = _DTYPES[precision]
        if self.dtype is not None:
            _check_autocast(precision, device, self.dtype)
        self._scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
        self._skipped = 0
        self._streak = 0  # consecutive non-finite losses

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        """The forward pass's context: autocast to the precision's dtype (fp32: none)."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call ``backward()`` on: scaled under fp16, else unchanged."""
        return loss if self._scaler is None else self._scaler.scale(loss)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the (averaged) gradients by the scale in place, so clipping sees their
        true norm; fp32/bf16: nothing. At most once per step."""
        if self._scaler is not None:
            self._scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step the optimizer; False when fp16's scaler skipped the step because the
        gradients held inf/NaN (the scale is then lowered)."""
        if self._scaler is None:
            optimizer.step()
            return True
        before = self._scaler.get_scale()
        self._scaler.step(optimizer)
        self._scaler.update()
        # update() multiplies the scale by backoff_factor (< 1) exactly when the step was
        # skipped and never lowers it otherwise: a lower scale is a skipped step, found
        # without the scaler's private per-optimizer state.
        if self._scaler.get_scale() < before:
            self._skipped += 1
            return False
        return True

    def loss_is_finite(self, value: float) -> bool:
        """Whether the loop may go on after a step whose loss is ``value``.

        A finite loss resets the streak. fp32/bf16 stop at the first non-finite loss;
        fp16 tolerates them (the scaler skips their steps, and an overflow is how it
        finds its scale) until ``skip_limit`` in a row.
        """
        if math.isfinite(value):
            self._streak = 0
            return True
        self._streak += 1
        return self._scaler is not None and self._streak < self.skip_limit

    @property
    def skipped_steps(self) -> int:
        """Steps the fp16 scaler skipped so far (0 otherwise)."""
        return self._skipped

    @property
    def loss_scale(self) -> float | None:
        """The scaler's current scale (fp16), else None."""
        return None if self._scaler is None else float(self._scaler.get_scale())

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The scaler's state (fp16), so a resumed run keeps its scale, and the counts."""
        return {
            "precision": self.precision,
            "skipped_steps": self._skipped,
            "nonfinite_streak": self._streak,
            "scaler": {} if self._scaler is None else self._scaler.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`. A scaler state is loaded only under fp16 (a
        run resumed in another precision starts without one)."""
        self._skipped = int(state.get("skipped_steps", 0))
        self._streak = int(state.get("nonfinite_streak", 0))
        scaler_state = state.get("scaler") or {}
        if self._scaler is not None and scaler_state:
            self._scaler.load_state_dict(dict(scaler_state))

    def describe(self) -> dict[str, Any]:
        """For the run summary, e.g. ``{"precision": "fp16", "autocast_dtype": "float16",
        "skipped_steps": 3, "loss_scale": 32768.0}`` (None where it does not apply)."""
        return {
            "precision": self.precision,
            "autocast_dtype": None
            if self.dtype is None
            else str(self.dtype).removeprefix("torch."),
            "skipped_steps": self._skipped,
            "loss_scale": self.loss_scale,
        }


def _check_autocast(precision: str, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse a precision this device's autocast cannot run: a tiny matmul under autocast
    must come out in ``dtype`` (torch turns an unsupported autocast into a warning and
    float32 results, which would make the setting a silent no-op)."""
    try:
        x = torch.ones(2, 2, device=device)
        with torch.autocast(device.type, dtype=dtype):
            out = torch.mm(x, x)
        ok, detail = out.dtype == dtype, f"a matmul came out {out.dtype}"
    except RuntimeError as exc:
        ok, detail = False, str(exc)
    if ok:
        return
    hint = (
        "fp16 needs CUDA (or a torch whose CPU autocast runs float16); use precision='bf16'"
        if precision == "fp16"
        else "use precision='fp32'"
    )
    raise ConfigError(
        f"precision={precision!r}: torch cannot autocast to {dtype} on device "
        f"{device.type!r} ({detail}); {hint}"
    )
