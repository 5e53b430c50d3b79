"""GPU scheduling without a GPU: local-cluster executors with made-up GPUs from a
discovery script (tests/integration/gpu_discovery.py), as pyspark's TorchDistributor
tests do. Every task of the training stage gets its own address, placement follows it
(CUDA is absent: ``device="auto"`` trains on the CPU, ``"cuda"`` fails clearly), and
only the training stage's resource profile asks for GPUs."""

from __future__ import annotations

import pytest
import torch

from sparktrain import Trainer
from sparktrain.driver import gpu
from sparktrain.driver.resources import max_concurrent_tasks
from sparktrain.driver.spark_env import ClassicEnv
from sparktrain.errors import ResourceError

from .fixtures import DIGITS_MODEL, digits_frames, fast_config

pytestmark = [
    pytest.mark.spark,
    pytest.mark.scale,  # a local-cluster session of its own: ~40 s to start on 2 cores
    pytest.mark.timeout(600),
    pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback without CUDA"),
]


def _stages(sc):  # type: ignore[no-untyped-def]
    """(resource profile id, description) of every stage the application ran."""
    jvm = sc._jvm
    stages = (
        sc._jsc.sc()
        .statusStore()
        .stageList(
            jvm.java.util.ArrayList(),  # every status
            False,
            False,
            sc._gateway.new_array(jvm.double, 0),
            jvm.java.util.ArrayList(),
        )
    )
    found = []
    for i in range(stages.length()):
        stage = stages.apply(i)
        found.append((int(stage.resourceProfileId()), str(stage.name())))
    return found


def test_the_training_stage_alone_holds_gpus(spark_gpu_cluster):
    sc = spark_gpu_cluster.sparkContext
    train, test = digits_frames(spark_gpu_cluster)
    cfg = fast_config(epochs=2, gpus_per_task=1, device="auto")
    result = Trainer(DIGITS_MODEL, cfg, spark=spark_gpu_cluster).fit(train, validation_data=test)
    placement = result.summary["placement"]
    assert sorted(p["gpus"][0] for p in placement) == ["0", "1"]  # one GPU each, distinct
    assert all(len(p["gpus"]) == 1 for p in placement)
    assert {(p["gpu"], p["device"]) for p in placement} == {(None, "cpu")}  # no CUDA here
    assert result.summary["metric_value"] > 0.8
    profile = gpu.profile_id(ClassicEnv(sc), cfg)
    assert profile > 0
    assert max_concurrent_tasks(ClassicEnv(sc), profile) == 2
    # the training stage on its profile; data preparation and warm-up on the default
    assert {p for p, _ in _stages(sc)} == {0, profile}

    def resources(_):  # type: ignore[no-untyped-def]
        from pyspark import TaskContext

        yield sorted(TaskContext.get().resources())

    # an ordinary stage afterwards holds no GPU
    assert sc.parallelize(range(2), 2).mapPartitions(resources).collect() == [[], []]


def test_device_cuda_without_cuda_fails_clearly(spark_gpu_cluster):
    train, _ = digits_frames(spark_gpu_cluster)
    cfg = fast_config(epochs=1, gpus_per_task=1, device="cuda", max_restarts=0)
    with pytest.raises(ResourceError, match="device='cuda' but CUDA is not available"):
        Trainer(DIGITS_MODEL, cfg, spark=spark_gpu_cluster).fit(train)


def test_more_gpus_per_task_than_executors_have_is_refused_at_once(spark_gpu_cluster):
    train, _ = digits_frames(spark_gpu_cluster)
    cfg = fast_config(epochs=1, gpus_per_task=2)  # executors have one GPU each
    with pytest.raises(ResourceError, match="gpus_per_task=2: Spark refuses.*gpu.amount=1"):
        Trainer(DIGITS_MODEL, cfg, spark=spark_gpu_cluster).fit(train)
