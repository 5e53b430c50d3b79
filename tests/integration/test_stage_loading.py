"""``sparktrain.ml.load_stage``: a saved pipeline from someone else, with every stage class
its metadata names checked before pyspark's readers import any of them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from pyspark.ml import PipelineModel
from pyspark.ml.feature import SQLTransformer

from sparktrain.errors import ConfigError
from sparktrain.ml import allowlist, load_stage

pytestmark = pytest.mark.spark

HOSTILE = "tests.unit.hostile_models"


def _saved_pipeline(spark, path: Path) -> Path:  # type: ignore[no-untyped-def]
    model = PipelineModel(stages=[SQLTransformer(statement="SELECT x * 2 AS y FROM __THIS__")])
    model.write().overwrite().save(str(path))
    return path


def _stage_metadata(path: Path) -> Path:
    return next((path / "stages").glob("*/metadata/part-*.txt"))


def test_a_trusted_pipeline_loads_and_transforms(spark, tmp_path):  # type: ignore[no-untyped-def]
    path = _saved_pipeline(spark, tmp_path / "p")
    loaded = load_stage(str(path), spark)
    assert isinstance(loaded, PipelineModel)
    rows = loaded.transform(spark.createDataFrame([(1.0,), (2.0,)], ["x"])).collect()
    assert [r["y"] for r in rows] == [2.0, 4.0]


def test_a_stage_class_outside_the_allowed_modules_is_refused_before_import(spark, tmp_path):  # type: ignore[no-untyped-def]
    path = _saved_pipeline(spark, tmp_path / "p")
    meta = _stage_metadata(path)
    record = json.loads(meta.read_text())
    record["class"] = f"{HOSTILE}.Anything"
    meta.write_text(json.dumps(record))
    (meta.parent / f".{meta.name}.crc").unlink()  # as an editor would: Hadoop checks it
    sys.modules.pop(HOSTILE, None)
    with pytest.raises(ConfigError) as err:
        load_stage(str(path), spark)
    message = str(err.value)
    assert f"names the class '{HOSTILE}.Anything'" in message
    assert f"allow_model_modules('{HOSTILE}')" in message
    assert HOSTILE not in sys.modules  # nothing of it ran
    # pyspark's own reader imports whatever the file names: the threat load_stage closes
    with pytest.raises(Exception):  # noqa: B017 - pyspark's error, whatever it is
        PipelineModel.load(str(path))
    assert HOSTILE in sys.modules
    sys.modules.pop(HOSTILE, None)


def test_a_module_the_user_allowed_passes_the_check(spark, tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    path = _saved_pipeline(spark, tmp_path / "p")
    meta = _stage_metadata(path)
    record = json.loads(meta.read_text())
    record["class"] = f"{HOSTILE}.net"
    meta.write_text(json.dumps(record))
    (meta.parent / f".{meta.name}.crc").unlink()
    monkeypatch.setattr(allowlist, "_REGISTERED", [HOSTILE])
    sys.modules.pop(HOSTILE, None)
    # past the check, pyspark's reader imports the stage's module (net has no load())
    with pytest.raises(AttributeError, match="load"):
        load_stage(str(path), spark)
    assert HOSTILE in sys.modules
    sys.modules.pop(HOSTILE, None)


def test_a_directory_without_metadata_says_so(spark, tmp_path):  # type: ignore[no-untyped-def]
    (tmp_path / "empty" / "data").mkdir(parents=True)
    (tmp_path / "empty" / "data" / "part-00000").write_text("{}")
    with pytest.raises(ConfigError, match="holds no pyspark.ml metadata"):
        load_stage(str(tmp_path / "empty"), spark)
