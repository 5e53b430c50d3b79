"""The sparktrain error hierarchy.

Every message says what went wrong *and* what to do about it. Errors raised inside a
Spark task travel to the driver as text; :func:`WorkerError.from_spark` recovers the
original class and message from Spark's wrapped traceback so users see our words,
not a Py4J stack.
"""

from __future__ import annotations

import difflib
import logging
import re
from collections.abc import Iterable


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`` Did you mean 'ring'?`` for the closest of ``choices`` to ``word`` (case
    ignored), or an empty string when none is close."""
    by_folded = {c.lower(): c for c in choices}
    close = difflib.get_close_matches(word.lower(), list(by_folded), n=1, cutoff=0.6)
    return f" Did you mean {by_folded[close[0]]!r}?" if close else ""


log = logging.getLogger(__name__)


class SparkTrainError(Exception):
    """Base class of every error sparktrain raises on purpose."""


class ConfigError(SparkTrainError, ValueError):
    """A configuration key or value is unknown or out of range."""


class DefaultsChangedWarning(UserWarning):
    """A fit runs on a default that changed in a release (docs/migration.md lists them):
    said once a process. Set the keys it names, or filter it
    (``warnings.filterwarnings("ignore", category=DefaultsChangedWarning)``)."""


class DataError(SparkTrainError, ValueError):
    """The training data does not fit the model or the config (columns, widths, NaN...)."""


class ResourceError(SparkTrainError):
    """The cluster cannot run the job as configured (too few slots, dynamic allocation...)."""


class CommError(SparkTrainError):
    """Communication between workers (or with the driver) failed."""


class HandshakeError(CommError):
    """A peer failed the authenticated handshake (wrong secret, wrong job, bad bytes)."""


class FrameError(CommError):
    """A frame on the wire is malformed, oversized or unexpected."""


class PeerLostError(CommError):
    """A peer stopped answering or closed its connection."""

    def __init__(self, rank: int, detail: str) -> None:
        self.rank = rank
        super().__init__(
            f"lost contact with rank {rank}: {detail}. The peer's task probably failed; "
            "check its executor log, or raise comm_timeout if it is merely slow."
        )

    def __reduce__(self) -> tuple[object, tuple[int, str]]:  # keep picklable across Spark
        return (_rebuild_peer_lost, (self.rank, str(self)))


def _rebuild_peer_lost(rank: int, message: str) -> PeerLostError:
    err = PeerLostError.__new__(PeerLostError)
    err.rank = rank
    Exception.__init__(err, message)
    return err


class DivergedError(SparkTrainError):
    """Training produced a non-finite loss or non-finite weights; final (a restart would
    diverge again from the same state)."""


class CheckpointError(SparkTrainError):
    """A checkpoint cannot be written, listed or read."""


class WorkerError(SparkTrainError):
    """An error raised inside a Spark task, surfaced on the driver."""

    _TAGGED = re.compile(r"sparktrain\.errors\.(\w+): (.*)")

    @classmethod
    def from_spark(cls, exc: BaseException) -> SparkTrainError:
        """Turn a Spark/Py4J exception into the sparktrain error a task raised, if any."""
        text = str(exc)
        # the tasks' tracebacks and the JVM's stack: for DEBUG only, the console gets
        # the one line the error says (sparktrain.driver.console keeps Spark's copies off)
        log.debug("the Spark error behind this failure:\n%s", text)
        found = None
        for line in text.splitlines():
            match = cls._TAGGED.search(line)
            if match:
                found = match  # the innermost (last) one is the cause
        if found is None:
            return cls(f"the training stage failed: {_cause(text)}")
        error_cls = _BY_NAME.get(found.group(1), cls)
        return error_cls(found.group(2).strip())


_EXCEPTION_LINE = re.compile(r"([\w.$]+(?:Error|Exception)): (.+)")


def _cause(text: str) -> str:
    """The most specific exception line of a Spark/Py4J error text (the last one that is
    not Py4J's own wrapper), else its first non-empty line."""
    best = None
    for line in text.splitlines():
        match = _EXCEPTION_LINE.search(line.strip())
        if match and "Py4JJavaError" not in match.group(1):
            best = f"{match.group(1).rsplit('.', 1)[-1]}: {match.group(2)}"
    if best:
        return best[:2000]
    return next(
        (line.strip()[:2000] for line in text.splitlines() if line.strip()), "unknown error"
    )


_BY_NAME: dict[str, type[SparkTrainError]] = {
    c.__name__: c
    for c in (
        SparkTrainError,
        ConfigError,
        DataError,
        ResourceError,
        CommError,
        HandshakeError,
        FrameError,
        WorkerError,
        CheckpointError,
        DivergedError,
    )
}
# PeerLostError's constructor takes a rank; its text already says everything.
_BY_NAME["PeerLostError"] = CommError


def not_a_spark_frame(data: object, what: str = "data") -> DataError:
    """The error for ``data`` that is not a pyspark DataFrame (nor an RDD), naming the
    call that makes one from what was given: pandas, numpy, a list."""
    kind = type(data)
    module = kind.__module__.split(".")[0]
    if module == "pandas":
        how = "spark.createDataFrame(pandas_df) turns a pandas DataFrame into one"
    elif module == "numpy":
        how = (
            "spark.createDataFrame(pandas.DataFrame(array)) turns an array into one, or "
            "sparktrain.datasets.to_dataframe(spark, x, y) for features and labels"
        )
    else:
        how = "spark.createDataFrame(rows, [column names]) makes one"
    return DataError(
        f"{what} must be a pyspark DataFrame (or an RDD of (features, label) pairs), got "
        f"{module}.{kind.__name__}: {how}"
    )
