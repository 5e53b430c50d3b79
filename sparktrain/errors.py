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


class UserCodeError(SparkTrainError):
    """The user's own code raised inside a task (a ``train_fn``, ``torch_run``'s
    function or script, a model's forward, a loss...): final, never resubmitted, since
    the same code on the same data would raise again. Lost tasks and executors
    (:class:`WorkerError`, :class:`CommError`) are still retried.

    ``rank`` is the rank that raised, ``type_name`` the exception's class (``ValueError``,
    ``mypkg.MyError``), ``user_message`` its message and ``traceback_text`` the rank's
    traceback (empty when only Spark's text reached the driver). When the class is a
    built-in one, the driver raises a subclass of it too (:func:`user_code_error`), so
    ``except ValueError`` catches it as it would in local code.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        type_name: str = "",
        user_message: str = "",
        traceback_text: str = "",
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.type_name = type_name
        self.user_message = user_message
        self.traceback_text = traceback_text

    def __reduce__(self) -> tuple[object, ...]:  # keyword-only fields survive pickling
        return (
            _rebuild_user_error,
            (
                str(self),
                self.rank,
                self.type_name,
                self.user_message,
                self.traceback_text,
            ),
        )

    @classmethod
    def headline(cls, rank: int, type_name: str, message: str) -> str:
        """The one line a task's error names: ``rank 1 raised ValueError: bad value``
        (the message's first line; Spark's text keeps one line per error)."""
        first = message.strip().splitlines()[0] if message.strip() else ""
        return f"rank {rank} raised {type_name}" + (f": {first}" if first else "")

    @classmethod
    def parse(cls, line: str) -> UserCodeError:
        """The error a headline (:meth:`headline`) recovered from Spark's text names."""
        match = _USER_HEADLINE.match(line)
        if match is None:
            return user_code_error(line)
        rank, type_name, message = int(match.group(1)), match.group(2), match.group(3) or ""
        return user_code_error(line, rank=rank, type_name=type_name, user_message=message)


_USER_HEADLINE = re.compile(r"rank (\d+) raised ([\w.]+)(?:: (.*))?$")

# Built-in exception classes a driver-side UserCodeError also derives from, so the
# caller's ``except ValueError`` behaves as with local code. Only classes whose
# constructor takes one message (a UnicodeDecodeError needs five arguments).
_BUILTIN_BASES: dict[str, type[Exception]] = {
    c.__name__: c
    for c in (
        ValueError,
        TypeError,
        KeyError,
        IndexError,
        LookupError,
        RuntimeError,
        AssertionError,
        ArithmeticError,
        ZeroDivisionError,
        OverflowError,
        AttributeError,
        NameError,
        NotImplementedError,
        ImportError,
        ModuleNotFoundError,
        FileNotFoundError,
        PermissionError,
        OSError,
        RecursionError,
    )
}
_USER_CLASSES: dict[str, type[UserCodeError]] = {}


def user_code_error(message: str, **fields: object) -> UserCodeError:
    """A :class:`UserCodeError` for ``message``; when ``type_name`` names a built-in
    exception class, of a subclass deriving from that class too."""
    base = _BUILTIN_BASES.get(str(fields.get("type_name", "")))
    cls: type[UserCodeError] = UserCodeError
    if base is not None:
        cls = _USER_CLASSES.setdefault(
            base.__name__,
            type(
                "UserCodeError",
                (UserCodeError, base),
                {
                    "__module__": __name__,
                    "__qualname__": f"UserCodeError[{base.__name__}]",
                    # KeyError's own __str__ quotes its argument: say the message as is
                    "__str__": Exception.__str__,
                },
            ),
        )
    err = cls.__new__(cls)
    UserCodeError.__init__(err, message, **fields)  # type: ignore[arg-type]
    return err


def _rebuild_user_error(
    message: str, rank: int | None, type_name: str, user_message: str, traceback_text: str
) -> UserCodeError:
    return user_code_error(
        message,
        rank=rank,
        type_name=type_name,
        user_message=user_message,
        traceback_text=traceback_text,
    )


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
        if found.group(1) == UserCodeError.__name__:
            return UserCodeError.parse(found.group(2).strip())
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
        UserCodeError,
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
