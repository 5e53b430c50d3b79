"""Data sets for jobs, tests and benchmarks: real ones from scikit-learn, synthetic ones
only for throughput."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from sparktrain.errors import ConfigError


@dataclass
class Split:
    """Train and test arrays of one data set."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int


def digits(test_fraction: float = 0.25, seed: int = 0) -> Split:
    """scikit-learn's bundled 8x8 handwritten digits (1,797 images), scaled to [0, 1],
    split stratified into train and test."""
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] != "sklearn":
            raise
        # scikit-learn is an extra, not a core dependency: say which one to install
        raise ConfigError(
            "the digits data set needs scikit-learn, which is not installed: "
            "pip install 'sparktrain[datasets]'"
        ) from exc

    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int64)
    xtr, xte, ytr, yte = train_test_split(
        x, y, test_size=test_fraction, random_state=seed, stratify=y
    )
    return Split(xtr, ytr, xte, yte, num_classes=10)


def synthetic(
    n: int = 100_000,
    features: int = 256,
    classes: int = 10,
    test_fraction: float = 0.1,
    seed: int = 0,
) -> Split:
    """A linearly separable-ish classification task from a random teacher: only for
    measuring throughput, never for claims about accuracy."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, features), dtype=np.float32)
    teacher = rng.standard_normal((features, classes), dtype=np.float32)
    y = np.argmax(x @ teacher + 0.5 * rng.standard_normal((n, classes)), axis=1).astype(np.int64)
    cut = int(n * (1 - test_fraction))
    return Split(x[:cut], y[:cut], x[cut:], y[cut:], num_classes=classes)


DATASETS = {"digits": digits, "synthetic": synthetic}


def load(name: str, **kwargs: object) -> Split:
    """Load a data set by name."""
    if name not in DATASETS:
        raise ConfigError(f"dataset {name!r} unknown; allowed: {', '.join(DATASETS)}")
    try:
        loader: Any = DATASETS[name]
        return loader(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"dataset {name!r} does not take {kwargs}: {exc}") from exc


def to_dataframe(spark: Any, x: np.ndarray, y: np.ndarray, partitions: int) -> Any:
    """A DataFrame with ``features`` (array<float>) and ``label`` (double) columns, built
    through Arrow (no per-row Python objects)."""
    import pyarrow as pa

    width = x.shape[1]
    features = pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1), pa.float32()), width)
    table = pa.table(
        {"features": features.cast(pa.list_(pa.float32())), "label": pa.array(y.astype(np.float64))}
    )
    return spark.createDataFrame(table).repartition(partitions)


def digit_bytes(x: np.ndarray) -> list[bytes]:
    """Digits' 8x8 pixel rows as :func:`digits` scales them ([0, 1] in steps of 1/16) as one
    ``bytes`` value each, an encoded image column's stand-in; :func:`decode_digit` turns
    one back into a ``(1, 8, 8)`` array of the same values."""
    return [row.tobytes() for row in np.rint(np.asarray(x) * 16).astype(np.uint8)]


def decode_digit(value: bytes) -> np.ndarray:
    """One :func:`digit_bytes` value as a float32 ``(1, 8, 8)`` image (a ``decode`` for
    binary columns: ``decode = {"image" = "sparktrain.datasets:decode_digit"}``)."""
    pixels = np.frombuffer(value, np.uint8)
    if pixels.size != 64:
        raise ValueError(f"a digit image has 64 pixels, this value has {pixels.size} bytes")
    return (pixels.astype(np.float32) / 16.0).reshape(1, 8, 8)


ORDER_A, ORDER_B = 1, 2
"""The two marker tokens of :func:`order_task` (0 is never drawn: it may pad)."""


def order_task(
    n: int, seed: int = 0, vocab: int = 16, lengths: tuple[int, int] = (8, 24)
) -> tuple[list[list[int]], np.ndarray]:
    """A sequence task where only order matters: each sequence (random length in
    ``lengths``) holds filler tokens from ``3..vocab-1`` and exactly one ``ORDER_A`` and
    one ``ORDER_B``; the label is 1 when A comes before B. Every sequence holds the same
    multiset of markers, so a bag-of-tokens model cannot beat 0.5."""
    rng = np.random.default_rng(seed)
    sequences, labels = [], np.zeros(n, dtype=np.int64)
    for i in range(n):
        length = int(rng.integers(lengths[0], lengths[1] + 1))
        seq = rng.integers(3, vocab, length)
        a, b = rng.choice(length, size=2, replace=False)
        seq[a], seq[b] = ORDER_A, ORDER_B
        sequences.append(seq.tolist())
        labels[i] = int(a < b)
    return sequences, labels


def zipf_ids(n: int, count: int, a: float, rng: np.random.Generator) -> np.ndarray:
    """``count`` int64 ids in ``[0, n)`` from a Zipf law truncated to ``n`` ids: id ``k``
    has probability proportional to ``(k + 1) ** -a``, so id 0 is the most frequent.

    Drawn by inverting the truncated law's CDF rather than with ``numpy.random.zipf``:
    that one is unbounded (with ``a = 1.1`` about a quarter of its draws exceed a
    million), and folding or redrawing the tail would change the law or loop."""
    if n < 1 or count < 0:
        raise ConfigError(f"zipf_ids needs n >= 1 and count >= 0, got n={n}, count={count}")
    if a <= 0:
        raise ConfigError(f"zipf_ids needs an exponent a > 0, got {a}")
    cdf = np.cumsum(np.arange(1, n + 1, dtype=np.float64) ** -a)
    cdf /= cdf[-1]
    ids = np.searchsorted(cdf, rng.random(count), side="right")
    return np.minimum(ids, n - 1).astype(np.int64)  # a draw of exactly 1.0 stays in range


@dataclass
class Clicks:
    """Synthetic click logs: who saw what and whether they clicked (:func:`clicks`)."""

    user: np.ndarray  # int64 [rows]
    item: np.ndarray  # int64 [rows]
    label: np.ndarray  # float32 [rows], 0.0 or 1.0
    ctr: np.ndarray  # float32 [rows]: the hidden model's click probability


def clicks(
    rows: int,
    num_users: int,
    num_items: int,
    a: float = 1.1,
    seed: int = 0,
    rank: int = 8,
) -> Clicks:
    """``rows`` impressions with user and item ids from Zipf(``a``) laws over the two
    tables and a click drawn from a hidden ground-truth model, so a recommender's loss can
    fall: ``logit = <u, v> / sqrt(rank) + 2 (b_user + b_item)`` with ``u``, ``v`` rank-``rank``
    Gaussian vectors and Gaussian biases per id. The biases are what a model learns
    first (popular ids click more or less), the dot product what it learns later. The
    same arguments give the same rows (one ``numpy`` generator seeded by ``seed``)."""
    if rows < 0 or num_users < 1 or num_items < 1 or rank < 1:
        raise ConfigError(
            f"clicks needs rows >= 0 and num_users, num_items, rank >= 1, got rows={rows}, "
            f"num_users={num_users}, num_items={num_items}, rank={rank}"
        )
    truth = np.random.default_rng([seed, 0])  # the hidden model: independent of rows
    draws = np.random.default_rng([seed, 1])
    user = zipf_ids(num_users, rows, a, draws)
    item = zipf_ids(num_items, rows, a, draws)
    # the whole hidden tables (1M x 9 floats is 36 MB), drawn before any row, so an id's
    # hidden vector does not depend on how many rows are drawn
    u = truth.standard_normal((num_users, rank + 1), dtype=np.float32)[user]
    v = truth.standard_normal((num_items, rank + 1), dtype=np.float32)[item]
    logit = (u[:, :rank] * v[:, :rank]).sum(axis=1) / np.sqrt(rank)
    logit += 2.0 * (u[:, rank] + v[:, rank])
    ctr = 1.0 / (1.0 + np.exp(-logit))
    label = (draws.random(rows) < ctr).astype(np.float32)
    return Clicks(user, item, label, ctr.astype(np.float32))


def clicks_dataframe(spark: Any, data: Clicks, partitions: int) -> Any:
    """A DataFrame with int64 ``user`` and ``item`` columns and a double ``label``, built
    through Arrow."""
    import pyarrow as pa

    table = pa.table(
        {
            "user": pa.array(data.user, pa.int64()),
            "item": pa.array(data.item, pa.int64()),
            "label": pa.array(data.label.astype(np.float64)),
        }
    )
    return spark.createDataFrame(table).repartition(partitions)
