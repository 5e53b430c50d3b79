"""The training stage's GPUs: a task-level resource profile, and its slots.

With ``gpus_per_task`` > 0 the barrier stage asks for its GPUs through stage-level
scheduling (``TaskResourceRequests().cpus(..).resource("gpu", n)``, the
``TaskResourceProfile`` xgboost.spark uses): only its tasks hold GPUs, while the ETL
stages before it run on the default profile. Executor-level profiles would need dynamic
allocation, which barrier stages refuse, so the profile asks nothing of executors; the
executors must already have GPUs (``spark.executor.resource.gpu.amount``).

Stage-level scheduling needs a cluster manager (standalone and local-cluster, YARN,
Kubernetes); under ``local[N]`` this logs that and the application's task resources
(``spark.task.resource.gpu.amount``) apply. ``gpus_per_task = 0`` asks nothing: tasks
get what the application's task resources give them.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from sparktrain.driver.spark_env import ClassicEnv, SparkEnv
from sparktrain.errors import ConfigError, ResourceError

if TYPE_CHECKING:
    from pyspark.resource import ResourceProfile

    from sparktrain.config import TrainConfig
    from sparktrain.driver.prepare import PreparedData

log = logging.getLogger(__name__)

# one profile per (context, cpus, gpus): a restarted stage reuses its profile, and Spark
# registers each built profile for good
_PROFILES: dict[tuple[int, int, int], ResourceProfile] = {}
_LOCK = threading.Lock()


def training_profile(env: SparkEnv, cfg: TrainConfig) -> ResourceProfile | None:
    """The training stage's task-level profile, or ``None`` (no GPUs asked for, or no
    stage-level scheduling on this master)."""
    if cfg.gpus_per_task <= 0:
        return None
    if env.is_local():
        log.warning(
            "gpus_per_task=%d: %s has no stage-level scheduling; the training stage runs "
            "with the application's task resources (spark.task.resource.gpu.amount=%s)",
            cfg.gpus_per_task,
            env.master,
            env.conf("spark.task.resource.gpu.amount", "0"),
        )
        return None
    if not isinstance(env, ClassicEnv):
        # registering the profile and counting its slots go through the SparkContext
        raise ConfigError(
            f"gpus_per_task={cfg.gpus_per_task} needs a classic session (its resource "
            "profile is registered through the SparkContext); under Spark Connect set "
            "gpus_per_task = 0 and give tasks their GPUs with the server's "
            "spark.task.resource.gpu.amount"
        )
    from pyspark.resource import ResourceProfileBuilder, TaskResourceRequests

    sc = env.sc
    cpus = env.task_cpus()
    key = (id(sc), cpus, cfg.gpus_per_task)
    with _LOCK:
        profile = _PROFILES.get(key)
        if profile is None:
            requests = TaskResourceRequests().cpus(cpus).resource("gpu", cfg.gpus_per_task)
            profile = ResourceProfileBuilder().require(requests).build
            # registered now (as withResources would at the stage), so the slot check
            # can count this profile's slots before the stage is submitted
            java = getattr(profile, "_java_resource_profile", None)
            if java is not None:
                try:
                    sc._jsc.sc().resourceProfileManager().addResourceProfile(java)
                except Exception as exc:  # Spark's check of the request against executors
                    raise ResourceError(
                        f"gpus_per_task={cfg.gpus_per_task}: Spark refuses the training "
                        f"stage's resource profile: {_spark_reason(exc)} (executors have "
                        "spark.executor.resource.gpu.amount="
                        f"{sc.getConf().get('spark.executor.resource.gpu.amount', '0')})"
                    ) from exc
            _PROFILES[key] = profile
            log.info(
                "the training stage asks for %d GPU(s) and %d CPU(s) per task "
                "(resource profile %s)",
                cfg.gpus_per_task,
                cpus,
                profile.id,
            )
    return profile


def _spark_reason(exc: Exception) -> str:
    """The first line of Spark's own message, without the Py4J wrapping."""
    for line in str(exc).splitlines():
        if "Exception:" in line:
            return line.split("Exception:", 1)[1].strip()
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def profile_id(env: SparkEnv, cfg: TrainConfig) -> int:
    """The id of the profile the training stage runs with (0: the default one)."""
    profile = training_profile(env, cfg)
    return 0 if profile is None else int(profile.id)


def env_of(prepared: PreparedData) -> SparkEnv:
    """Spark as the prepared data sees it (only asked for when GPUs are)."""
    if prepared.frame is not None:
        from sparktrain.driver.spark_env import spark_env

        return spark_env(prepared.frame.sparkSession)
    assert prepared.rdd is not None
    return ClassicEnv(prepared.rdd.context)


def map_in_arrow_options(prepared: PreparedData, cfg: TrainConfig) -> dict[str, Any]:
    """Keyword arguments for the training stage's ``mapInArrow``: its profile, if any."""
    if cfg.gpus_per_task <= 0:
        return {}
    profile = training_profile(env_of(prepared), cfg)
    return {} if profile is None else {"profile": profile}
