"""Validation metrics that are exact over every rank's rows.

Each rank feeds its own validation batches to a :class:`Scores`; :meth:`Scores.finish`
combines the ranks with collectives, so the figures are those of the whole validation set.
(An average of per-rank figures would weight ranks rather than rows, and gets ratios such
as F1 or R² wrong even with equal shards.)

* Sum-based metrics (accuracy, top_k, macro_f1, log_loss, rmse, mae, r2) keep a float64
  vector of weighted sums whose length depends only on the metrics and ``num_outputs``;
  one ``reduce_sum`` adds the ranks' vectors.
* AUC and user callables need every row: the columns they need are kept and one
  ``gather`` fetches all ranks' rows (only when one of them is requested).

Both calls are collectives: every rank makes them in the same order with the same vector
length / row width, whatever its own data (a rank may have no rows).

Conventions. Classification outputs are logits ``(n, C)``; a single logit ``(n,)`` or
``(n, 1)`` (``num_outputs=1``) is binary and is treated as the two logits ``[0, z]``, whose
softmax is ``[1 - sigmoid(z), sigmoid(z)]``: argmax thresholds at logit 0 (0 itself is
class 0), log_softmax is logsigmoid, and one code path serves both. Labels are class indices
for classification and shaped like the outputs for regression. Optional per-row weights act
as scikit-learn's ``sample_weight``. A metric is NaN when the total weight is 0 (no rows).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence

import numpy as np
import torch

from sparktrain.config import check_metric_name
from sparktrain.errors import ConfigError, DataError

Metric = str | Callable[..., float]
_REGRESSION = ("rmse", "mae", "r2")
# Label variance below this fraction of the labels' mean square is rounding noise of the
# raw moments (sum w*y², sum w*y): r2 then treats the output's labels as constant.
_CONSTANT_LABELS = 1e-12


def metric_key(metric: Metric) -> str:
    """The result key of a metric: its name (``"top_k:5"``), or a callable's ``__name__``."""
    if isinstance(metric, str):
        return metric
    return getattr(metric, "__name__", None) or type(metric).__name__


def _takes_weights(fn: Callable[..., float]) -> bool:
    """Whether ``fn`` accepts three positional arguments (outputs, labels, weights)."""
    try:
        inspect.signature(fn).bind(None, None, None)
    except (TypeError, ValueError):  # ValueError: no signature (some builtins): call with two
        return False
    return True


class Scores:
    """Accumulates one rank's validation outputs batch by batch; :meth:`finish` gives exact
    figures over every rank's rows.

    ``metrics``: names from :data:`sparktrain.config.METRICS` or callables
    ``fn(outputs, labels[, weights]) -> float``, called on every rank with all ranks' rows
    (float64 tensors in rank order; weights are ones where none were given).
    ``num_outputs``: the model's output width (classes, 1 for one binary logit, or
    regression outputs). ``label_scale`` multiplies rmse and mae, for labels standardised
    during training; r2 does not depend on it.

    macro_f1 is the unweighted mean over all ``max(num_outputs, 2)`` classes of
    F1 = 2·TP / (true + predicted) from weighted counts; a class with no true and no
    predicted rows counts 0, as scikit-learn's ``f1_score(labels=range(C),
    average="macro")`` with its default ``zero_division``. top_k counts a row when fewer
    than K classes score strictly above its true class (ties favour the row). log_loss is
    the mean of -log_softmax at the true class, unclipped (scikit-learn clips
    probabilities at float64 eps, which only matters for logits beyond about ±36).
    """

    def __init__(
        self, metrics: Sequence[Metric], *, num_outputs: int, label_scale: float = 1.0
    ) -> None:
        if isinstance(num_outputs, bool) or not isinstance(num_outputs, int) or num_outputs < 1:
            raise ConfigError(f"num_outputs={num_outputs!r} must be an integer >= 1")
        if not (math.isfinite(label_scale) and label_scale > 0):
            raise ConfigError(f"label_scale={label_scale!r} must be a finite number > 0")
        self.metrics = list(metrics)
        self.num_outputs = num_outputs
        self.label_scale = float(label_scale)
        self.classes = max(num_outputs, 2)  # one logit is binary
        for metric in self.metrics:
            check_metric_name(metric)
        keys = [metric_key(m) for m in self.metrics]
        if len(set(keys)) < len(keys):
            raise ConfigError(f"metrics: two metrics share a name in {keys}; name callables apart")
        # Where each statistic sits in the summed vector: fixed by the metrics and
        # num_outputs alone, so every rank's vector has the same length.
        self._at: dict[str, slice] = {}
        self._add("weight", 1)
        for metric in self.metrics:
            if not isinstance(metric, str):
                continue
            if metric.startswith("top_k:") and int(metric[6:]) > self.classes:
                raise ConfigError(
                    f"metrics: {metric} asks for more classes than the model has "
                    f"({self.classes}); use K <= {self.classes}"
                )
            if metric == "auc" and num_outputs > 2:
                raise ConfigError(
                    f"metrics: auc is binary (one logit or two classes); this model has "
                    f"{num_outputs} classes: use accuracy, top_k:K, macro_f1 or log_loss"
                )
            if metric in _REGRESSION:  # sse, sae, sum w*y, sum w*y² per output, shared
                self._add("regression", 4 * num_outputs)
            elif metric != "auc":
                self._add(metric, 3 * self.classes if metric == "macro_f1" else 1)
        self._callables = [(m, _takes_weights(m)) for m in self.metrics if callable(m)]
        self._auc = "auc" in self.metrics
        # Kept row columns: weight, [auc score, positive], [outputs, labels zero-padded to
        # num_outputs, 1-D output flag, label width (0: 1-D)]; fixed width, as gather needs.
        self._auc_col = 1
        self._call_col = 3 if self._auc else 1
        self._width = self._call_col + (2 * num_outputs + 2 if self._callables else 0)
        self.reset()

    def _add(self, name: str, size: int) -> None:
        if name not in self._at:
            end = max((s.stop for s in self._at.values()), default=0)
            self._at[name] = slice(end, end + size)

    def reset(self) -> None:
        """Forget every row seen (e.g. at the start of the next epoch's validation)."""
        self._sums = np.zeros(max(s.stop for s in self._at.values()), dtype=np.float64)
        self._kept: list[np.ndarray] = []

    def update(
        self, outputs: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None
    ) -> None:
        """Add one batch: model ``outputs`` (logits or regression outputs), ``labels`` and
        optional non-negative per-row ``weights`` ``(n,)``."""
        k = self.num_outputs
        out = outputs.detach().to("cpu", torch.float64)
        y = labels.detach().to("cpu", torch.float64)
        if not ((out.ndim == 2 and out.shape[1] == k) or (out.ndim == 1 and k == 1)):
            raise DataError(
                f"validation outputs have shape {tuple(out.shape)}; expected (n, {k})"
                + (" or (n,)" if k == 1 else "")
            )
        n = out.shape[0]
        flat = out.reshape(n, k)
        if weights is None:
            w = torch.ones(n, dtype=torch.float64)
        else:
            w = weights.detach().to("cpu", torch.float64).reshape(-1)
            if w.numel() != n or bool((w < 0).any()):
                raise DataError(f"weights must be {n} non-negative numbers, one per row")
        if n == 0:
            return
        # Check every shape before adding anything, so a bad batch leaves the sums alone.
        classify = any(isinstance(m, str) and m not in _REGRESSION for m in self.metrics)
        cls = y.reshape(-1)
        if classify and (
            cls.numel() != n
            or bool(((cls < 0) | (cls >= self.classes) | (cls != cls.round())).any())
        ):
            raise DataError(
                f"classification metrics need one integer class index in [0, {self.classes}) "
                f"per row; got labels of shape {tuple(y.shape)} that are not that"
            )
        if "regression" in self._at and y.numel() != n * k:
            raise DataError(f"regression labels have shape {tuple(y.shape)}; expected ({n}, {k})")
        labels2 = y.reshape(n, -1)
        if self._callables and (y.ndim > 2 or labels2.shape[1] > k):
            raise DataError(f"labels of shape {tuple(y.shape)} are wider than the outputs")

        at, sums = self._at, self._sums
        sums[at["weight"]] += float(w.sum())
        # One block of kept rows per batch, AUC and callable columns side by side.
        kept = torch.zeros(n, self._width, dtype=torch.float64)
        kept[:, 0] = w
        if classify:
            self._classify(flat, cls.long(), w, kept)
        if "regression" in at:
            target = y.reshape(n, k)
            err = flat - target
            wc = w[:, None]
            parts = (wc * err**2, wc * err.abs(), wc * target, wc * target**2)
            sums[at["regression"]] += torch.cat([p.sum(0) for p in parts]).numpy()
        if self._callables:
            c = self._call_col
            kept[:, c : c + k] = flat
            kept[:, c + k : c + k + labels2.shape[1]] = labels2
            kept[:, c + 2 * k] = float(out.ndim == 1)
            kept[:, c + 2 * k + 1] = 0.0 if y.ndim == 1 else labels2.shape[1]
        if self._width > 1:
            self._kept.append(kept.numpy())

    def _classify(
        self, flat: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, kept: torch.Tensor
    ) -> None:
        """Add one batch's classification sums; fill its AUC columns of ``kept``."""
        one = flat.shape[1] == 1  # one logit z: the two logits [0, z]
        logits = torch.cat([torch.zeros_like(flat), flat], 1) if one else flat
        pred = logits.argmax(1)
        true_score = logits.gather(1, idx[:, None])
        above = (logits > true_score).sum(1)  # classes ranked strictly above the true one
        for metric in self.metrics:
            if not isinstance(metric, str) or metric not in self._at:
                continue
            at = self._at[metric]
            if metric == "accuracy":
                self._sums[at] += float((w * (pred == idx)).sum())
            elif metric.startswith("top_k:"):
                self._sums[at] += float((w * (above < int(metric[6:]))).sum())
            elif metric == "log_loss":
                nll = -(torch.log_softmax(logits, 1).gather(1, idx[:, None]).squeeze(1))
                self._sums[at] += float((w * nll).sum())
            elif metric == "macro_f1":
                hit = pred == idx
                counts = [
                    torch.bincount(idx[hit], w[hit], self.classes),
                    torch.bincount(pred, w, self.classes),
                    torch.bincount(idx, w, self.classes),
                ]
                self._sums[at] += torch.cat(counts).numpy()
        if self._auc:
            kept[:, self._auc_col] = logits[:, 1] - logits[:, 0]  # monotone in p(class 1)
            kept[:, self._auc_col + 1] = (idx == 1).double()

    def finish(
        self,
        reduce_sum: Callable[[np.ndarray], np.ndarray],
        gather: Callable[[np.ndarray], np.ndarray],
    ) -> dict[str, float]:
        """Exact metrics over every rank's rows, keyed by :func:`metric_key`.

        ``reduce_sum(a)`` returns the elementwise sum over ranks of a 1-D float64 array;
        ``gather(a)`` returns all ranks' rows of a 2-D float64 array, in rank order. Every
        rank must call ``finish`` at the same point: it makes one ``reduce_sum`` and, when
        auc or a callable is requested, one ``gather``.
        """
        # A copy, so a collective that reduces in place cannot corrupt the running sums.
        sums = np.asarray(reduce_sum(self._sums.copy()), dtype=np.float64)
        rows = np.zeros((0, self._width))
        if self._width > 1:
            mine = np.concatenate(self._kept) if self._kept else rows
            rows = np.asarray(gather(mine), dtype=np.float64).reshape(-1, self._width)
        total = float(sums[self._at["weight"]][0])
        return {metric_key(m): self._value(m, sums, total, rows) for m in self.metrics}

    def _value(self, metric: Metric, sums: np.ndarray, total: float, rows: np.ndarray) -> float:
        if not isinstance(metric, str):
            return self._call(metric, rows)
        if total <= 0:
            return math.nan
        k = self.num_outputs
        if metric == "auc":
            c = self._auc_col
            return _auc(rows[:, c], rows[:, c + 1] > 0.5, rows[:, 0])
        if metric == "macro_f1":
            tp, predicted, true = sums[self._at[metric]].reshape(3, self.classes)
            denom = predicted + true
            f1 = np.divide(2 * tp, denom, out=np.zeros_like(denom), where=denom > 0)
            return float(f1.mean())
        if metric in _REGRESSION:
            sse, sae, swy, swy2 = sums[self._at["regression"]].reshape(4, k)
            if metric == "rmse":
                return math.sqrt(sse.sum() / (total * k)) * self.label_scale
            if metric == "mae":
                return float(sae.sum() / (total * k)) * self.label_scale
            # r2 per output from raw moments, with scikit-learn's force_finite for
            # constant labels (1 if predicted exactly, else 0), then the plain mean.
            sst = np.maximum(swy2 - swy**2 / total, 0.0)
            constant = sst <= _CONSTANT_LABELS * swy2
            r2 = np.where(constant, (sse == 0).astype(float), 1 - sse / np.where(constant, 1, sst))
            return float(r2.mean())
        return float(sums[self._at[metric]][0]) / total  # accuracy, top_k, log_loss

    def _call(self, metric: Callable[..., float], rows: np.ndarray) -> float:
        """A user callable on every rank's rows, with the shapes the ranks fed in."""
        if rows.shape[0] == 0:
            return math.nan
        k, c = self.num_outputs, self._call_col
        flags = np.unique(rows[:, c + 2 * k])
        widths = np.unique(rows[:, c + 2 * k + 1])
        if len(flags) > 1 or len(widths) > 1:
            raise DataError("validation batches differ in output or label shape across rows")
        outputs = torch.from_numpy(np.ascontiguousarray(rows[:, c : c + k]))
        if flags[0]:
            outputs = outputs[:, 0]
        width = int(widths[0])
        labels = torch.from_numpy(np.ascontiguousarray(rows[:, c + k : c + k + max(width, 1)]))
        if width == 0:
            labels = labels[:, 0]
        weights = torch.from_numpy(np.ascontiguousarray(rows[:, 0]))
        # By identity: a callable object need not be hashable.
        takes = next(t for fn, t in self._callables if fn is metric)
        return float(metric(outputs, labels, weights) if takes else metric(outputs, labels))


def _auc(score: np.ndarray, positive: np.ndarray, weight: np.ndarray) -> float:
    """Weighted binary ROC AUC, exact, ties counted half: the weighted share of
    (positive, negative) pairs the score orders correctly. NaN with one class only."""
    order = np.argsort(score, kind="stable")
    score, positive, weight = score[order], positive[order], weight[order]
    wpos = np.where(positive, weight, 0.0)
    wneg = weight - wpos
    total_pos, total_neg = wpos.sum(), wneg.sum()
    if total_pos <= 0 or total_neg <= 0:
        return math.nan
    starts = np.flatnonzero(np.r_[True, score[1:] != score[:-1]])  # runs of tied scores
    pos, neg = np.add.reduceat(wpos, starts), np.add.reduceat(wneg, starts)
    neg_below = np.cumsum(neg) - neg
    return float((pos * (neg_below + 0.5 * neg)).sum() / (total_pos * total_neg))
