"""Loading a saved pyspark.ml stage that someone else wrote: a ``PipelineModel``, a
``CrossValidatorModel``, one of ours or any MLlib stage, with every class its metadata
names checked before anything is imported.

pyspark's readers (``PipelineModel.load``, ``CrossValidatorModel.load``, ...) import the
class that each stage's metadata names and call its ``load``. The file chooses the
module, and importing a module runs its code. sparktrain's own readers check the
functions our stages name (:mod:`sparktrain.ml.allowlist`), but pyspark's pipeline
readers import each stage's class before any of our code runs. :func:`load_stage`
reads every metadata file under the directory first, and refuses a class outside
pyspark.ml (MLlib's stages, saved under their ``org.apache.spark.ml`` names),
``sparktrain.ml`` and the modules allowed for saved models.
"""

from __future__ import annotations

import importlib
import json
import os
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from sparktrain.errors import ConfigError
from sparktrain.ml.allowlist import module_allowed

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

#: Stage classes every load accepts: MLlib's and ours.
STAGE_MODULES = ("pyspark.ml", "sparktrain.ml")
# MLlib's metadata names its stages by their JVM class; pyspark maps them the same way
_JVM_PREFIX, _PY_PREFIX = "org.apache.spark", "pyspark"


def load_stage(path: str, spark: SparkSession | None = None) -> Any:
    """The pyspark.ml stage saved at ``path``, loaded by its own reader once every class
    named under ``path`` (the pipeline's stages, a tuning model's best model and
    sub-models, at any depth) is in :data:`STAGE_MODULES` or a module allowed with
    :func:`~sparktrain.ml.allow_model_modules` (or ``spark.sparktrain.allowedModelModules``).

    Use it instead of ``PipelineModel.load(path)`` for a directory you did not write.
    Raises :class:`~sparktrain.errors.ConfigError` naming the metadata file and the class.
    """
    from pyspark.sql import SparkSession

    from sparktrain.ml.persistence import allowed_in

    session = spark or SparkSession.active()
    allowed = (*STAGE_MODULES, *allowed_in(session))
    classes = stage_classes(session, path)
    root = next((c for f, c in classes.items() if _is_root(f, path)), None)
    if root is None:
        raise ConfigError(f"{path} holds no pyspark.ml metadata (metadata/part-*)")
    for where, name in sorted(classes.items()):
        module = python_class(name).rpartition(".")[0]
        if not module_allowed(module, allowed):
            raise ConfigError(
                f"refusing to load {path}: {where} names the class {name!r}, whose module "
                f"{module!r} is not an allowed stage module ({', '.join(allowed)}). Loading "
                "it would import that module and run its code. If you trust this model's "
                f"source, call sparktrain.ml.allow_model_modules({module!r}) first"
            )
    module_name, _, class_name = python_class(root).rpartition(".")
    stage_class = getattr(importlib.import_module(module_name), class_name)
    return stage_class.load(path)


def stage_classes(spark: SparkSession, path: str) -> dict[str, str]:
    """``{metadata file: class}`` for every pyspark.ml metadata file under ``path``, read
    with Spark (any file system it reaches, classic or Connect) in one job."""
    from pyspark.sql import functions as F

    rows = (
        spark.read.option("recursiveFileLookup", "true")
        # metadata files: part-00000 (older saves) or part-*.txt; data is parquet
        .option("pathGlobFilter", "{part-?????,part-*.txt}")
        .text(path)
        .select(F.input_file_name().alias("file"), "value")
        .collect()
    )
    found: dict[str, str] = {}
    for row in rows:
        if "/metadata/part-" not in row["file"]:
            continue
        try:
            name = json.loads(row["value"]).get("class")
        except (ValueError, AttributeError):
            continue  # not a metadata line: nothing a reader would import
        if not isinstance(name, str):
            raise ConfigError(f"{row['file']}: the metadata's class is {name!r}, not a name")
        found[row["file"]] = name
    return found


def python_class(name: str) -> str:
    """The Python class pyspark's reader imports for a metadata ``class``."""
    return name.replace(_JVM_PREFIX, _PY_PREFIX, 1) if name.startswith(_JVM_PREFIX) else name


def _is_root(file: str, path: str) -> bool:
    """Is ``file`` (a URI, as Spark lists it) the metadata of ``path`` itself?"""
    folder, _, name = _location(file).rpartition("/")
    return folder == f"{_location(path).rstrip('/')}/metadata" and name.startswith("part-")


def _location(path: str) -> str:
    """``path`` without its scheme and host, absolute: what Spark's listing and the
    caller's path have in common."""
    parsed = urlparse(path)
    return parsed.path if parsed.scheme else os.path.abspath(path)
