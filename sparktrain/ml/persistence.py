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
anything is imported, unless the caller passes ``model_fn`` to ``load`` itself, and so
must every other function the metadata names: the ``decode`` / ``collate`` params and
the hooks of the saved ``inputs`` layout. ``weightsFile`` must stay inside the model
directory. A saved estimator's names are checked the same way, and a loaded estimator
drops its logger destinations (``tensorboardDir``, ``mlflowTrackingUri``).

Both files go through Hadoop's FileSystem (the one Spark uses for the metadata), so a
model can live wherever Spark can write: a local path, ``file:``, ``hdfs:``, ``s3a:``...

Under Spark Connect the client has no JVM: the metadata is still written and read by
Spark (on the server, through the DataFrame API), the weights file by this client with
plain file IO, so there a model lives at an absolute local path or a ``file:`` URI the
server and the client share (the same host, or a shared disk). The files are the same
either way: a model saved under Connect loads in a classic session and back.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import uuid
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast
from urllib.parse import urlparse

from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter, MLReader, MLWriter

from sparktrain.data.columns import Layout
from sparktrain.driver.spark_env import is_connect
from sparktrain.errors import ConfigError, DataError
from sparktrain.ml.allowlist import (
    ALLOWED_MODULES_CONF,
    SavedName,
    allowed_model_modules,
    check_saved_names,
    conf_prefixes,
)
from sparktrain.result import state_from_bytes

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from sparktrain.ml.estimator import TorchEstimator
    from sparktrain.ml.model import TorchModel

log = logging.getLogger(__name__)

WEIGHTS_FILE = "data/weights.pt"
WEIGHTS_FORMAT = "torch.save(state_dict); load with weights_only=True"
_CHUNK = 4 << 20  # bytes per Py4J call
#: Params of a saved model or estimator that name ``"module:function"`` hooks per column.
HOOK_PARAMS = ("decode", "collate")
#: Estimator params naming where a run sends its metrics and its weights: a loaded
#: estimator does not keep them (fitting it would write to whatever the file names).
LOGGER_PARAMS = ("tensorboardDir", "mlflowTrackingUri")
# one part of weightsFile: a plain file or directory name (no '.', '..', hidden or empty
# part, no ':' of a URI scheme, no separator of another OS)
_PATH_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")

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
        metadata = load_metadata(path, spark, self.cls)
        instance = self.cls()
        instance._resetUid(metadata["uid"])
        DefaultParamsReader.getAndSetParams(instance, metadata)
        if _names_no_label_scaling(instance, metadata):
            instance._setDefault(labelScaling=False)  # saved before it: trained without
        layout = saved_layout(metadata, path)
        weights = _join(path, saved_weights_file(metadata, path))
        # every function the metadata names, before anything is imported or read
        check_loaded_names(instance, path, self.model_fn, allowed_in(spark), layout)
        blob = read_bytes(spark, weights)
        state = state_from_bytes(blob, where=weights)
        instance._set_state(
            blob,
            num_features=int(metadata["numFeatures"]),
            num_outputs=metadata["numClasses"],
            layout=layout,
            label_stats=saved_label_stats(metadata, path),
        )
        instance._check_state(state)  # the factory still builds a module these weights fit
        return instance


class TorchEstimatorReader(DefaultParamsReader[E]):
    """pyspark's params reader, plus the allowlist check of every function the saved
    estimator names (fitting it would import and call them), and without its logger
    destinations (:data:`LOGGER_PARAMS`).

    It builds ``cls`` itself, after checking that the metadata's ``"class"`` names it:
    pyspark's ``DefaultParamsReader.load`` would import whatever module that field names
    and call the attribute with no arguments."""

    def __init__(self, cls: type[E], model_fn: str | None = None) -> None:
        super().__init__(cls)
        self.model_fn = model_fn

    def load(self, path: str) -> E:
        spark = self.sparkSession
        metadata = load_metadata(path, spark, self.cls)
        instance = cast("E", self.cls())
        instance._resetUid(metadata["uid"])
        DefaultParamsReader.getAndSetParams(instance, metadata)
        check_loaded_names(instance, path, self.model_fn, allowed_in(spark))
        drop_logger_destinations(instance, path)
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


def load_metadata(path: str, spark: SparkSession, cls: type[Any]) -> dict[str, Any]:
    """The metadata JSON of a save of ``cls``. Its ``"class"`` must name ``cls``: the
    reader builds ``cls`` itself and imports nothing the field names (pyspark's own
    ``DefaultParamsReader.load`` imports that module and calls the attribute)."""
    metadata: dict[str, Any] = DefaultParamsReader.loadMetadata(path, spark)
    expected = f"{cls.__module__}.{cls.__name__}"
    if metadata.get("class") != expected:
        raise ConfigError(
            f"refusing to load {path} as {cls.__name__}: its metadata names the class "
            f"{metadata.get('class')!r}, not {expected!r}; load it with that class's load, "
            "or check that the directory is the save you meant"
        )
    return metadata


def saved_weights_file(metadata: dict[str, Any], path: str) -> str:
    """The weights file a saved model names, relative to its directory: plain names
    joined by ``/``, so that it stays inside the model directory (no absolute path, no
    URI, no ``..``)."""
    name = metadata.get("weightsFile", WEIGHTS_FILE)
    if not isinstance(name, str) or not all(_PATH_PART.fullmatch(p) for p in name.split("/")):
        raise ConfigError(
            f"refusing to load {path}: its weightsFile {name!r} is not a path inside the "
            "model directory (a relative path of plain names: no absolute path, no URI, "
            f"no '..'); sparktrain saves {WEIGHTS_FILE!r}. Is the metadata intact?"
        )
    return name


def allowed_in(spark: SparkSession) -> tuple[str, ...]:
    """The module prefixes saved models may name here: the process-wide allowlist plus
    the Spark conf ``spark.sparktrain.allowedModelModules``, read on the driver now."""
    return allowed_model_modules(conf_prefixes(spark.conf.get(ALLOWED_MODULES_CONF, None)))


def saved_names(
    instance: TorchModel | TorchEstimator[Any],
    model_fn: str | None,
    layout: Layout | None = None,
) -> list[SavedName]:
    """Every ``"module:function"`` a loaded model or estimator names, as set or recorded
    as a default (a default comes back when the set value is cleared): ``modelFn``
    (unless the caller's ``model_fn`` replaces it, which is set here and not checked),
    the ``decode`` / ``collate`` params, and a model's trained layout's hooks
    (``inputs``, what ``transform`` runs on the executors)."""
    hint = f"{type(instance).__name__}.load(path, model_fn='package.module:function')"
    names: list[SavedName] = []
    if model_fn is not None:
        instance._set(modelFn=model_fn)
        if instance.hasDefault(instance.modelFn):
            instance._setDefault(modelFn=model_fn)
    elif not instance.isDefined(instance.modelFn):
        raise ConfigError(f"the saved model names no modelFn; pass the factory yourself: {hint}")
    else:
        names += [SavedName(f"modelFn{how}", v, hint) for how, v in _recorded(instance, "modelFn")]
    for param in HOOK_PARAMS:
        for how, text in _recorded(instance, param):
            table = json.loads(text)  # canonical JSON (the param's converter wrote it)
            names += [SavedName(f"{param}[{col!r}]{how}", hook) for col, hook in table.items()]
    for column in layout.columns if layout is not None else ():
        for hook, value in (("decode", column.decode), ("collate", column.collate)):
            if value is not None:  # a non-string is refused as malformed
                names.append(SavedName(f"inputs.{hook}[{column.key!r}]", value))
    return names


def _recorded(instance: Any, name: str) -> list[tuple[str, Any]]:
    """("" or " (default)", value) of a param as set and as a default, where there is one."""
    param = instance.getParam(name)
    found = []
    if instance.isSet(param):
        found.append(("", instance._paramMap[param]))
    if instance.hasDefault(param) and instance._defaultParamMap[param] is not None:
        found.append((" (default)", instance._defaultParamMap[param]))
    return found


def check_loaded_names(
    instance: TorchModel | TorchEstimator[Any],
    path: str,
    model_fn: str | None,
    allowed: tuple[str, ...],
    layout: Layout | None = None,
) -> None:
    """Refuse a loaded model or estimator that names a function outside ``allowed``
    (:func:`saved_names`; all are checked before anything is imported), or whose allowed
    names do not resolve to functions of their allowed modules."""
    try:
        names = saved_names(instance, model_fn, layout)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    check_saved_names(names, allowed, source=path)


def drop_logger_destinations(instance: TorchEstimator[Any], path: str) -> None:
    """Clear the logger destinations a loaded estimator names (:data:`LOGGER_PARAMS`),
    set or recorded as defaults, with a warning: fitting it would send the run's metrics
    and its weights to whatever server or directory the file names."""
    dropped = {}
    fresh = type(instance)()  # the class defaults (off), not the ones the file recorded
    for name in LOGGER_PARAMS:
        param = instance.getParam(name)
        value = instance.getOrDefault(param)
        instance.clear(param)
        instance._setDefault(**{name: fresh.getOrDefault(name)})
        if value and value != instance.getOrDefault(param):
            dropped[name] = value
    if dropped:
        setters = ", ".join(f"set{n[0].upper()}{n[1:]}({v!r})" for n, v in dropped.items())
        log.warning(
            "%s names logger destinations %s; a loaded estimator does not keep them (fitting "
            "it would send the run's metrics and weights there). If you trust them, set "
            "them again: %s",
            path,
            dropped,
            setters,
        )


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
