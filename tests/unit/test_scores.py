"""Exact validation metrics across ranks (task/scores.py) against scikit-learn.

Ranks run in threads; a barrier-based fake collective plays reduce_sum and gather, so each
rank makes the real calls in the real order. Every case splits the rows unevenly over
three ranks, one of them with no rows at all, and feeds each rank in several batches.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from sklearn import datasets, metrics
from sklearn.exceptions import UndefinedMetricWarning
from sklearn.linear_model import Ridge, RidgeClassifier
from sklearn.preprocessing import StandardScaler

from sparktrain.errors import ConfigError, DataError
from sparktrain.task.scores import Scores, metric_key

TOL = 1e-9


class FakeGroup:
    """reduce_sum and gather between ranks in threads; logs every call per rank."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world, timeout=10)  # a mismatch fails, not hangs
        self.slots: list[Any] = [None] * world
        # (kind, length or width): what must match across ranks; rows may differ
        self.calls: list[list[tuple[str, int]]] = [[] for _ in range(world)]

    def _exchange(self, rank: int, kind: str, a: np.ndarray) -> list[np.ndarray]:
        assert a.dtype == np.float64
        self.calls[rank].append((kind, a.shape[-1]))
        self.slots[rank] = a.copy()
        self.barrier.wait()
        everything = list(self.slots)
        self.barrier.wait()  # nobody refills a slot before every rank has read it
        return everything

    def reduce_sum(self, rank: int) -> Callable[[np.ndarray], np.ndarray]:
        def call(a: np.ndarray) -> np.ndarray:
            assert a.ndim == 1
            parts = self._exchange(rank, "reduce_sum", a)
            assert len({p.shape for p in parts}) == 1, "reduce_sum lengths differ by rank"
            a[:] = -1.0  # an in-place collective must not corrupt the running sums
            return np.sum(parts, axis=0)

        return call

    def gather(self, rank: int) -> Callable[[np.ndarray], np.ndarray]:
        def call(a: np.ndarray) -> np.ndarray:
            assert a.ndim == 2
            parts = self._exchange(rank, "gather", a)
            assert len({p.shape[1] for p in parts}) == 1, "gather widths differ by rank"
            return np.concatenate(parts, axis=0)

        return call


def split(n: int) -> list[slice]:
    """Three ranks: the middle one has no rows; the others uneven shares."""
    cut = (3 * n) // 5
    return [slice(0, cut), slice(cut, cut), slice(cut, n)]


def run(
    make: Callable[[], Scores],
    outputs: np.ndarray,
    labels: np.ndarray,
    weights: np.ndarray | None = None,
    parts: Sequence[slice] | None = None,
    batch: int = 97,
) -> tuple[dict[str, float], FakeGroup]:
    """Every rank's finish() over its rows; checks all ranks agree and returns rank 0's."""
    parts = split(len(outputs)) if parts is None else parts
    group = FakeGroup(len(parts))
    results: list[Any] = [None] * len(parts)

    def rank_main(rank: int) -> None:
        try:
            scores = make()
            rows = np.arange(len(outputs))[parts[rank]]
            for start in range(0, len(rows), batch):
                r = rows[start : start + batch]
                w = None if weights is None else torch.from_numpy(weights[r])
                scores.update(torch.from_numpy(outputs[r]), torch.from_numpy(labels[r]), w)
            results[rank] = scores.finish(group.reduce_sum(rank), group.gather(rank))
        except BaseException as exc:
            group.barrier.abort()
            results[rank] = exc

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(len(parts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for res in results:
        if isinstance(res, BaseException):
            raise res
    for res in results[1:]:
        assert res.keys() == results[0].keys()
        for key, value in res.items():
            assert value == results[0][key] or (math.isnan(value) and math.isnan(results[0][key]))
    assert all(c == group.calls[0] for c in group.calls), "ranks made different collectives"
    return results[0], group


def close(got: dict[str, float], want: dict[str, float]) -> None:
    assert got.keys() == want.keys()
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=TOL, abs=TOL), key


def sample_weights(n: int, seed: int = 0) -> np.ndarray:
    w = np.random.default_rng(seed).uniform(0.0, 3.0, n)
    w[::7] = 0.0  # zero weights count for nothing, as in scikit-learn
    return w


@pytest.fixture(scope="module")
def digits() -> tuple[np.ndarray, np.ndarray]:
    """Ten-class decision scores of a ridge classifier on the digits (imperfect: ~7% errors
    in-sample after the noise), with integer labels."""
    x, y = datasets.load_digits(return_X_y=True)
    scores = RidgeClassifier(alpha=1.0).fit(x[:900], y[:900]).decision_function(x)
    scores = scores + np.random.default_rng(1).normal(0, 0.3, scores.shape)
    return scores, y.astype(np.int64)


@pytest.fixture(scope="module")
def cancer() -> tuple[np.ndarray, np.ndarray]:
    """One binary logit per row (a ridge classifier's decision function) and 0/1 labels."""
    x, y = datasets.load_breast_cancer(return_X_y=True)
    x = StandardScaler().fit_transform(x)
    z = RidgeClassifier(alpha=10.0).fit(x[:200], y[:200]).decision_function(x)
    return 3.0 * z, y.astype(np.float32)  # float labels, as a bce model is fed


def softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


@pytest.mark.parametrize("weighted", [False, True])
def test_multiclass_matches_sklearn(digits: Any, weighted: bool) -> None:
    out, y = digits
    w = sample_weights(len(y)) if weighted else None
    names = ["accuracy", "top_k:1", "top_k:3", "top_k:10", "macro_f1", "log_loss"]
    got, group = run(lambda: Scores(names, num_outputs=10), out, y, w)
    labels = list(range(10))
    close(
        got,
        {
            "accuracy": metrics.accuracy_score(y, out.argmax(1), sample_weight=w),
            "top_k:1": metrics.top_k_accuracy_score(y, out, k=1, sample_weight=w),
            "top_k:3": metrics.top_k_accuracy_score(y, out, k=3, sample_weight=w),
            "top_k:10": 1.0,
            "macro_f1": metrics.f1_score(
                y, out.argmax(1), labels=labels, average="macro", sample_weight=w
            ),
            "log_loss": metrics.log_loss(y, softmax(out), labels=labels, sample_weight=w),
        },
    )
    assert 0.5 < got["accuracy"] < 0.99  # the case is not degenerate
    # One reduce_sum for every sum-based metric together (weight, accuracy, 3 top_k,
    # 3x10 confusion counts, log_loss), and no gather.
    assert group.calls[0] == [("reduce_sum", 36)]


def test_macro_f1_absent_class_counts_zero() -> None:
    """A class with no true and no predicted row scores 0 (sklearn's zero_division default
    with labels=range(C)); a class present only through zero-weight rows likewise."""
    y = np.array([0, 0, 1, 1, 1, 2, 0, 1])
    pred = np.array([0, 1, 1, 1, 0, 2, 0, 1])
    out = np.eye(4)[pred]
    w = np.array([1.0, 2.0, 0.5, 1.0, 1.0, 0.0, 3.0, 1.0])  # class 2 only at weight 0
    for weights in (None, w):
        got, _ = run(lambda: Scores(["macro_f1"], num_outputs=4), out, y, weights, batch=3)
        with pytest.warns(UndefinedMetricWarning):
            want = metrics.f1_score(
                y, pred, labels=[0, 1, 2, 3], average="macro", sample_weight=weights
            )
        close(got, {"macro_f1": want})


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("shape", ["(n,)", "(n,1)"])
def test_binary_single_logit(cancer: Any, weighted: bool, shape: str) -> None:
    z, y = cancer
    w = sample_weights(len(y), seed=2) if weighted else None
    out = z if shape == "(n,)" else z[:, None]
    names = ["accuracy", "top_k:1", "top_k:2", "macro_f1", "auc", "log_loss"]
    got, group = run(lambda: Scores(names, num_outputs=1), out, y, w)
    pred = (z > 0).astype(int)
    close(
        got,
        {
            "accuracy": metrics.accuracy_score(y, pred, sample_weight=w),
            "top_k:1": metrics.accuracy_score(y, pred, sample_weight=w),
            "top_k:2": 1.0,
            "macro_f1": metrics.f1_score(y, pred, average="macro", sample_weight=w),
            "auc": metrics.roc_auc_score(y, z, sample_weight=w),
            "log_loss": metrics.log_loss(y, 1 / (1 + np.exp(-z)), sample_weight=w),
        },
    )
    assert 0.6 < got["auc"] < 0.999
    kinds = [kind for kind, _ in group.calls[0]]
    assert kinds == ["reduce_sum", "gather"]


@pytest.mark.parametrize("weighted", [False, True])
def test_binary_two_logits(cancer: Any, weighted: bool) -> None:
    z, y = cancer
    w = sample_weights(len(y), seed=3) if weighted else None
    rng = np.random.default_rng(4)
    out = np.stack([-0.5 * z, 0.5 * z], axis=1) + rng.normal(0, 0.5, (len(z), 2))
    names = ["accuracy", "macro_f1", "auc", "log_loss"]
    got, _ = run(lambda: Scores(names, num_outputs=2), out, y.astype(np.int32), w)
    close(
        got,
        {
            "accuracy": metrics.accuracy_score(y, out.argmax(1), sample_weight=w),
            "macro_f1": metrics.f1_score(y, out.argmax(1), average="macro", sample_weight=w),
            "auc": metrics.roc_auc_score(y, out[:, 1] - out[:, 0], sample_weight=w),
            "log_loss": metrics.log_loss(y, softmax(out), sample_weight=w),
        },
    )
    # AUC of the softmax probability is the same ranking
    assert got["auc"] == pytest.approx(
        metrics.roc_auc_score(y, softmax(out)[:, 1], sample_weight=w), rel=TOL
    )


@pytest.mark.parametrize("weighted", [False, True])
def test_auc_ties_count_half(cancer: Any, weighted: bool) -> None:
    z, y = cancer
    coarse = np.round(z / 2.0)  # a handful of distinct scores: heavy ties across ranks
    assert len(np.unique(coarse)) < 15
    w = sample_weights(len(y), seed=5) if weighted else None
    got, _ = run(lambda: Scores(["auc"], num_outputs=1), coarse, y, w, batch=31)
    close(got, {"auc": metrics.roc_auc_score(y, coarse, sample_weight=w)})
    # All scores tied: exactly one half.
    got, _ = run(lambda: Scores(["auc"], num_outputs=1), np.zeros(len(y)), y, w)
    assert got["auc"] == pytest.approx(0.5, rel=TOL)


def test_auc_one_class_is_nan() -> None:
    out = np.linspace(-1, 1, 20)
    got, _ = run(lambda: Scores(["auc", "accuracy"], num_outputs=1), out, np.ones(20))
    assert math.isnan(got["auc"])
    assert got["accuracy"] == 0.5
    # Negatives present only with weight 0: one class by weight.
    y = (np.arange(20) % 2).astype(float)
    w = y.copy()
    got, _ = run(lambda: Scores(["auc"], num_outputs=1), out, y, w)
    assert math.isnan(got["auc"])


@pytest.mark.parametrize("weighted", [False, True])
def test_regression_with_label_scale(weighted: bool) -> None:
    """Labels standardised for training: rmse/mae come back in label units, r2 unchanged."""
    x, y = datasets.load_diabetes(return_X_y=True)
    pred = Ridge(alpha=0.1).fit(x[:250], y[:250]).predict(x)
    mean, scale = y.mean(), y.std()
    ys, ps = (y - mean) / scale, (pred - mean) / scale
    w = sample_weights(len(y), seed=6) if weighted else None
    names = ["rmse", "mae", "r2"]
    for out, lab in ((ps, ys), (ps[:, None], ys[:, None])):
        got, group = run(lambda: Scores(names, num_outputs=1, label_scale=scale), out, lab, w)
        close(
            got,
            {
                "rmse": math.sqrt(metrics.mean_squared_error(y, pred, sample_weight=w)),
                "mae": metrics.mean_absolute_error(y, pred, sample_weight=w),
                "r2": metrics.r2_score(y, pred, sample_weight=w),
            },
        )
        assert group.calls[0] == [("reduce_sum", 5)]  # weight + 4 sums for one output


@pytest.mark.parametrize("weighted", [False, True])
def test_regression_multi_output(weighted: bool) -> None:
    """Per-output r2 averaged (uniform_average); rmse/mae over every output."""
    x, y = datasets.load_linnerud(return_X_y=True)
    rng = np.random.default_rng(7)
    # linnerud has 20 rows; repeat with noise for enough rows to batch over ranks
    x = np.concatenate([x + rng.normal(0, 1, x.shape) for _ in range(10)])
    y = np.concatenate([y + rng.normal(0, 2, y.shape) for _ in range(10)])
    pred = Ridge(alpha=1.0).fit(x[:50], y[:50]).predict(x)
    w = sample_weights(len(y), seed=8) if weighted else None
    got, _ = run(lambda: Scores(["rmse", "mae", "r2"], num_outputs=3), pred, y, w, batch=13)
    close(
        got,
        {
            "rmse": math.sqrt(metrics.mean_squared_error(y, pred, sample_weight=w)),
            "mae": metrics.mean_absolute_error(y, pred, sample_weight=w),
            "r2": metrics.r2_score(y, pred, sample_weight=w),
        },
    )


def test_r2_constant_output_follows_sklearn() -> None:
    """An output whose labels are constant scores 1 if predicted exactly, else 0."""
    rng = np.random.default_rng(9)
    y = np.stack([rng.normal(size=50), np.full(50, 7.25)], axis=1)
    for second in (np.full(50, 7.25), np.full(50, 7.0)):
        pred = np.stack([y[:, 0] + rng.normal(0, 0.3, 50), second], axis=1)
        got, _ = run(lambda: Scores(["r2"], num_outputs=2), pred, y, batch=7)
        close(got, {"r2": metrics.r2_score(y, pred)})


def test_callables_see_every_row_on_every_rank(digits: Any) -> None:
    out, y = digits
    w = sample_weights(len(y), seed=10)
    seen: list[tuple[Any, ...]] = []
    lock = threading.Lock()

    def error_rate(outputs: torch.Tensor, labels: torch.Tensor) -> float:
        with lock:
            seen.append((outputs.dtype, outputs.shape, labels.dtype, labels.shape))
        return float((outputs.argmax(1) != labels).double().mean())

    def weighted_hits(outputs: torch.Tensor, labels: torch.Tensor, weights: Any) -> Any:
        hits = (outputs.argmax(1) == labels).double()
        return (hits * weights).sum() / weights.sum()  # a 0-d tensor is fine too

    names: list[Any] = [error_rate, weighted_hits, "accuracy"]
    got, group = run(lambda: Scores(names, num_outputs=10), out, y, w)
    close(
        got,
        {
            "error_rate": 1 - metrics.accuracy_score(y, out.argmax(1)),
            "weighted_hits": metrics.accuracy_score(y, out.argmax(1), sample_weight=w),
            "accuracy": metrics.accuracy_score(y, out.argmax(1), sample_weight=w),
        },
    )
    assert seen == [(torch.float64, (len(y), 10), torch.float64, (len(y),))] * 3
    assert [kind for kind, _ in group.calls[0]] == ["reduce_sum", "gather"]


def test_callable_gets_rows_in_rank_order_and_shapes() -> None:
    """Regression rows with 2-D labels and 1-D outputs reach the callable as fed, in rank
    order, exactly; weights default to ones."""
    rng = np.random.default_rng(11)
    out, y = rng.normal(size=40), rng.normal(size=(40, 1))
    got_rows: list[Any] = []

    def grab(outputs: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> float:
        got_rows.append((outputs.numpy().copy(), labels.numpy().copy(), weights.numpy().copy()))
        return 0.0

    res, _ = run(lambda: Scores([grab, "rmse"], num_outputs=1), out, y, batch=6)
    assert len(got_rows) == 3
    for outputs, labels, weights in got_rows:
        np.testing.assert_array_equal(outputs, out)
        np.testing.assert_array_equal(labels, y)
        np.testing.assert_array_equal(weights, np.ones(40))
    assert res["rmse"] == pytest.approx(np.sqrt(np.mean((out - y[:, 0]) ** 2)), rel=TOL)


def test_auc_and_callable_share_one_gather(cancer: Any) -> None:
    z, y = cancer

    def mean_logit(outputs: torch.Tensor, labels: torch.Tensor) -> float:
        return float(outputs.mean())

    got, group = run(lambda: Scores(["auc", mean_logit], num_outputs=1), z, y)
    close(got, {"auc": metrics.roc_auc_score(y, z), "mean_logit": float(z.mean())})
    assert [kind for kind, _ in group.calls[0]] == ["reduce_sum", "gather"]


def test_no_rows_anywhere_is_nan() -> None:
    called: list[int] = []

    def fn(outputs: torch.Tensor, labels: torch.Tensor) -> float:
        called.append(1)
        return 1.0

    names: list[Any] = ["accuracy", "top_k:2", "macro_f1", "auc", "log_loss", fn]
    got, group = run(lambda: Scores(names, num_outputs=2), np.zeros((0, 2)), np.zeros(0))
    assert got.keys() == {metric_key(m) for m in names}
    assert all(math.isnan(v) for v in got.values())
    assert not called
    assert [kind for kind, _ in group.calls[0]] == ["reduce_sum", "gather"]
    got, _ = run(
        lambda: Scores(["rmse", "mae", "r2"], num_outputs=3), np.zeros((0, 3)), np.zeros((0, 3))
    )
    assert all(math.isnan(v) for v in got.values())


def test_reset_forgets_rows(cancer: Any) -> None:
    z, y = cancer
    scores = Scores(["accuracy", "auc"], num_outputs=1)
    scores.update(torch.from_numpy(-z), torch.from_numpy(y))  # a first epoch, all wrong
    scores.reset()
    scores.update(torch.from_numpy(z), torch.from_numpy(y))

    def clobbering_sum(a: np.ndarray) -> np.ndarray:  # a world of one that reduces in place
        out = a.copy()
        a[:] = -1.0
        return out

    want = {"accuracy": metrics.accuracy_score(y, z > 0), "auc": metrics.roc_auc_score(y, z)}
    close(scores.finish(clobbering_sum, lambda a: a), want)
    close(scores.finish(clobbering_sum, lambda a: a), want)  # finish leaves the sums intact


def test_metric_key() -> None:
    def my_metric(outputs: torch.Tensor, labels: torch.Tensor) -> float:
        return 0.0

    assert metric_key("top_k:5") == "top_k:5"
    assert metric_key(my_metric) == "my_metric"


def test_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"top_k:11 .*more classes.*\(10\)"):
        Scores(["top_k:11"], num_outputs=10)
    with pytest.raises(ConfigError, match="top_k:3"):
        Scores(["top_k:3"], num_outputs=1)  # one logit: two classes
    Scores(["top_k:2"], num_outputs=1)
    with pytest.raises(ConfigError, match="auc is binary"):
        Scores(["auc"], num_outputs=3)
    with pytest.raises(ConfigError, match="not a metric"):
        Scores(["f1"], num_outputs=3)
    with pytest.raises(ConfigError, match="share a name"):
        Scores([lambda o, y: 0.0, lambda o, y: 1.0], num_outputs=3)


def test_data_errors() -> None:
    scores = Scores(["accuracy"], num_outputs=3)
    with pytest.raises(DataError, match="class index"):
        scores.update(torch.zeros(2, 3), torch.tensor([0, 3]))
    with pytest.raises(DataError, match="class index"):
        scores.update(torch.zeros(2, 3), torch.tensor([0.0, 1.5]))
    with pytest.raises(DataError, match=r"shape \(2, 4\)"):
        scores.update(torch.zeros(2, 4), torch.tensor([0, 1]))
    with pytest.raises(DataError, match="non-negative"):
        scores.update(torch.zeros(2, 3), torch.tensor([0, 1]), torch.tensor([1.0, -1.0]))
    with pytest.raises(DataError, match="regression labels"):
        Scores(["rmse"], num_outputs=2).update(torch.zeros(2, 2), torch.zeros(2))
    # a rejected batch adds nothing
    scores.update(torch.eye(3), torch.tensor([0, 1, 2]))
    assert scores.finish(lambda a: a, lambda a: a) == {"accuracy": 1.0}
