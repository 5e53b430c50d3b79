"""Saving and loading sparktrain ml models the MLlib way.

A saved model is a directory::

    PATH/metadata/part-00000     MLlib metadata JSON (DefaultParamsWriter): class, uid,
                                 params, plus numFeatures / numClasses / weights file,
                                 inputs (the trained Layout.to_dict()) and labelScaling
                                 ({"mean", "std"} of a regressor trained on standardised
                                 labels, else null)
    PATH/data/weights.pt         the state_dict of the module modelFn builds, written by
                                 torch.save (without the label scaling wrapper)

Older saves load with today's defaults: params missing from the metadata (those added
since, such as ``dataMemoryInMB``, ``featuresCols`` or the training loop's ``lrSchedule``
to ``mlflowExperiment``) keep their class defaults, and a
model saved without ``inputs`` reads as the plain layout of its ``numFeatures``. A
regression model saved before label scaling (no ``labelScaling`` figures) predicts its
output as it is, and its ``labelScaling`` param defaults to ``False``, as it was trained;
an estimator saved before it has the class default (``True``). The defaults a save
recorded (MLlib's ``defaultParamMap``) stay its defaults: an estimator saved with the
old ``optimizer="sgd"`` default trains with SGD when loaded.

The weights file is read back with ``torch.load(weights_only=True)``, which only rebuilds
tensors and plain containers, and the architecture is rebuilt by calling ``modelFn`` with
``modelKwargs`` — nothing unpickles user bytes. Before that, the ``modelFn`` the metadata
names must be in an allowed module (:mod:`sparktrain.ml.allowlist`), checked before
anything is imported, unless the caller passes ``model_fn`` to ``load`` itself; a saved
estimator's ``modelFn`` is checked the same way. Both files go through Hadoop's FileSystem
(the one Spark uses for the metadata), so a model can live wherever Spark can write:
a local path, ``file:``, ``hdfs:``, ``s3a:``...

Under Spark Connect the client has no JVM: the metadata is still written and read by
Spark (on the server, through the DataFrame API), the weights file by this client with
plain file IO, so there a model lives at an absolute local path or a ``file:`` URI the
server and the client share (the same host, or a shared disk). The files are the same
either way: a model saved under Connect loads in a classic session and back.
"""

from __future__ import annotations

import math
import os
import uuid
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast
from urllib.parse import urlparse

from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter, MLReader, MLWriter

from sparktrain.data.columns import Layout
from sparktrain.errors import ConfigError, DataError
from sparktrain.launch.spark_env import is_connect
from sparktrain.ml.allowlist import (
    ALLOWED_MODULES_CONF,
    allowed_model_modules,
    check_saved_model_fn,
    conf_prefixes,
)
from sparktrain.result import state_from_bytes

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from sparktrain.ml.estimator import TorchEstimator
    from sparktrain.ml.model import TorchModel

WEIGHTS_FILE = "data/weights.pt"
WEIGHTS_FORMAT = "torch.save(state_dict); load with weights_only=True"
_CHUNK = 4 << 20  # bytes per Py4J call

M = TypeVar("M", bound="TorchModel")
E = TypeVar("E", bound="TorchEstimator[Any]")


class ConnectAwareWriter(MLWriter):
    """pyspark's writer, whose ``overwrite()`` also works under Spark Connect (pyspark's
    own reaches for the JVM; under Connect the server deletes the old save, as it does
    for pyspark's Pipelines)."""

    def _handleOverwrite(self, path: str) -> None:
        if not is_connect(self.sparkSession):
            super()._handleOverwrite(path)
            return
        from pyspark.ml.connect.readwrite import RemoteMLWriter

        RemoteMLWriter.handleOverwrite(path, True)


class TorchEstimatorWriter(ConnectAwareWriter, DefaultParamsWriter):
    """pyspark's params writer for the estimators, with :class:`ConnectAwareWriter`'s
    overwrite."""


class TorchModelWriter(ConnectAwareWriter):
    """Writes metadata JSON and the weights file of a :class:`TorchModel`."""

    def __init__(self, instance: TorchModel) -> None:
        super().__init__()
        self.instance = instance

    def saveImpl(self, path: str) -> None:
        weights = _join(path, WEIGHTS_FILE)
        if is_connect(self.sparkSession):  # a path this client can write, before Spark writes
            connect_local_path(weights)
        extra = {
            "numFeatures": self.instance.numFeatures,
            "numClasses": self.instance._num_outputs_meta(),
            "weightsFile": WEIGHTS_FILE,
            "weightsFormat": WEIGHTS_FORMAT,
            "inputs": self.instance.layout.to_dict(),
            "labelScaling": self.instance._label_stats_meta(),
        }
        DefaultParamsWriter.saveMetadata(self.instance, path, self.sparkSession, extra)
        write_bytes(self.sparkSession, weights, self.instance._state_bytes)


class TorchModelReader(MLReader[M], Generic[M]):
    """Reads what :class:`TorchModelWriter` wrote and checks that the architecture built
    from ``modelFn`` + ``modelKwargs`` takes the saved weights."""

    def __init__(self, cls: type[M], model_fn: str | None = None) -> None:
        super().__init__()
        self.cls = cls
        self.model_fn = model_fn

    def load(self, path: str) -> M:
        spark = self.sparkSession
        expected = f"{self.cls.__module__}.{self.cls.__name__}"
        metadata = DefaultParamsReader.loadMetadata(path, spark, expected)
        instance = self.cls()
        instance._resetUid(metadata["uid"])
        DefaultParamsReader.getAndSetParams(instance, metadata)
        if _names_no_label_scaling(instance, metadata):
            instance._setDefault(labelScaling=False)  # saved before it: trained without
        check_loaded_model_fn(instance, spark, path, self.model_fn)  # before any import
        weights = _join(path, str(metadata.get("weightsFile", WEIGHTS_FILE)))
        blob = read_bytes(spark, weights)
        state = state_from_bytes(blob, where=weights)
        instance._set_state(
            blob,
            num_features=int(metadata["numFeatures"]),
            num_outputs=metadata["numClasses"],
            layout=saved_layout(metadata, path),
            label_stats=saved_label_stats(metadata, path),
        )
        instance._check_state(state)  # the factory still builds a module these weights fit
        return instance


class TorchEstimatorReader(DefaultParamsReader[E]):
    """pyspark's params reader, plus the allowlist check of the ``modelFn`` it loads
    (fitting a loaded estimator would import and call it)."""

    def __init__(self, cls: type[E], model_fn: str | None = None) -> None:
        super().__init__(cls)
        self.model_fn = model_fn

    def load(self, path: str) -> E:
        instance = cast("E", super().load(path))
        check_loaded_model_fn(instance, self.sparkSession, path, self.model_fn)
        return instance


def saved_layout(metadata: dict[str, Any], path: str) -> Layout | None:
    """The layout a saved model was trained on; ``None`` (the plain layout of its
    ``numFeatures``) for a model saved before layouts were kept."""
    inputs = metadata.get("inputs")
    if not inputs:
        return None
    try:
        return Layout.from_dict(inputs)
    except (KeyError, TypeError, ValueError) as exc:
        raise DataError(
            f"{path}: the saved model's 'inputs' (its input columns) cannot be read ({exc!r}); "
            "is the metadata intact?"
        ) from exc


def saved_label_stats(metadata: dict[str, Any], path: str) -> tuple[float, float] | None:
    """The ``(mean, std)`` a saved regressor's labels were standardised with; ``None``
    (outputs are predictions) for a model without them, e.g. saved before label scaling."""
    figures = metadata.get("labelScaling")
    if not figures:
        return None
    try:
        mean, std = float(figures["mean"]), float(figures["std"])
    except (KeyError, TypeError, ValueError) as exc:
        raise DataError(
            f"{path}: the saved model's 'labelScaling' figures cannot be read ({exc!r}); "
            "is the metadata intact?"
        ) from exc
    if not (math.isfinite(mean) and math.isfinite(std) and std > 0):
        raise DataError(
            f"{path}: the saved model's 'labelScaling' figures (mean={mean!r}, std={std!r}) "
            "are not a finite mean and a finite std > 0; is the metadata intact?"
        )
    return mean, std


def _names_no_label_scaling(instance: Any, metadata: dict[str, Any]) -> bool:
    """A regression model whose metadata predates the labelScaling param."""
    if not instance.hasParam("labelScaling"):
        return False
    sections = (metadata.get("paramMap") or {}, metadata.get("defaultParamMap") or {})
    return not any("labelScaling" in section for section in sections)


def check_loaded_model_fn(
    instance: TorchModel | TorchEstimator[Any],
    spark: SparkSession,
    path: str,
    model_fn: str | None,
) -> None:
    """Refuse a loaded ``modelFn`` outside the allowed modules (nothing is imported
    first), or replace it with the caller's ``model_fn``, which is not checked."""
    name = type(instance).__name__
    if model_fn is not None:
        instance._set(modelFn=model_fn)
        return
    hint = f"{name}.load(path, model_fn='package.module:function')"
    if not instance.isDefined(instance.modelFn):
        raise ConfigError(f"{path} names no modelFn; pass the factory yourself: {hint}")
    conf = spark.conf.get(ALLOWED_MODULES_CONF, None)
    allowed = allowed_model_modules(conf_prefixes(conf))
    check_saved_model_fn(instance.getModelFn(), allowed, source=path, override_hint=hint)


# ---------------------------------------------------------------------- Hadoop FS
def _join(path: str, child: str) -> str:
    return path.rstrip("/") + "/" + child


def _hadoop(spark: SparkSession, path: str) -> tuple[Any, Any]:
    sc = spark.sparkContext
    jvm: Any = sc._jvm
    jpath = jvm.org.apache.hadoop.fs.Path(path)
    return jpath.getFileSystem(sc._jsc.hadoopConfiguration()), jpath


def write_bytes(spark: SparkSession, path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` through the Hadoop FileSystem Spark uses (overwrites);
    under Spark Connect to the local file the path names."""
    if is_connect(spark):
        _write_local(connect_local_path(path), data)
        return
    fs, jpath = _hadoop(spark, path)
    out = fs.create(jpath, True)
    try:
        view = memoryview(data)
        for start in range(0, len(view), _CHUNK):
            out.write(bytes(view[start : start + _CHUNK]))
    finally:
        out.close()


def read_bytes(spark: SparkSession, path: str) -> bytes:
    """Read the whole file at ``path`` through the Hadoop FileSystem Spark uses; under
    Spark Connect the local file the path names."""
    if is_connect(spark):
        local = connect_local_path(path)
        if not os.path.isfile(local):
            raise DataError(f"{path} does not exist: is this a saved sparktrain model?")
        with open(local, "rb") as f:
            return f.read()
    fs, jpath = _hadoop(spark, path)
    if not fs.exists(jpath):
        raise DataError(f"{path} does not exist: is this a saved sparktrain model?")
    size = int(fs.getFileStatus(jpath).getLen())
    jvm: Any = spark.sparkContext._jvm
    stream = fs.open(jpath)
    try:
        parts: list[bytes] = []
        remaining = size
        while remaining > 0:
            chunk = bytes(
                jvm.org.apache.commons.io.IOUtils.toByteArray(stream, min(_CHUNK, remaining))
            )
            parts.append(chunk)
            remaining -= len(chunk)
        return b"".join(parts)
    finally:
        stream.close()


# ---------------------------------------------------------------------- Spark Connect
def connect_local_path(path: str) -> str:
    """The local file a model path names under Spark Connect, where this client writes
    and reads the weights itself: an absolute path or a ``file:`` URI (``file:/x``,
    ``file:///x``, ``file://localhost/x``). A relative path would resolve against the
    server's working directory for the metadata but this process's for the weights, and
    other schemes need Hadoop's FileSystem, which a Connect client does not have."""
    parsed = urlparse(path)
    if parsed.scheme == "file" and parsed.netloc in ("", "localhost"):
        local = parsed.path
    elif parsed.scheme == "" and os.path.isabs(path):
        local = path
    else:
        raise ConfigError(
            f"under Spark Connect a sparktrain model is saved and loaded at an absolute local "
            f"path or a file: URI on a disk the Connect server and this client share, not "
            f"{path!r} (the server writes the metadata, this client the weights); other file "
            "systems (hdfs:, s3a:...) need a classic session for now"
        )
    if not os.path.isabs(local):
        raise ConfigError(f"{path!r} does not name an absolute path")
    return local


def _write_local(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` whole or not at all (a temporary file renamed over it)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    partial = f"{path}.{uuid.uuid4().hex}.tmp"
    try:
        with open(partial, "wb") as f:
            f.write(data)
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
