"""Checks the driver makes before launching a barrier stage, so that a job that cannot be
gang-scheduled fails at once with a clear message instead of Spark's 10-minute retry.

They read Spark through :class:`~sparktrain.driver.spark_env.SparkEnv`: a classic
session's SparkContext, or a Spark Connect session's ``spark.conf``. What a Connect
client cannot see (free slots on a cluster without static executors, Spark's encryption
settings when the server hides them) is logged as not checked, and left to Spark.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from typing import TYPE_CHECKING

from sparktrain.comm_backend import check_torch_transport  # torch's plaintext collectives
from sparktrain.errors import ConfigError, ResourceError
from sparktrain.strategies import registry

if TYPE_CHECKING:
    from sparktrain.config import TrainConfig
    from sparktrain.driver.spark_env import SparkEnv

log = logging.getLogger(__name__)


def task_cpus(env: SparkEnv) -> int:
    return env.task_cpus()


def max_concurrent_tasks(env: SparkEnv, profile_id: int = 0) -> int | None:
    """Task slots Spark can run at once right now (what barrier scheduling needs), for
    the resource profile ``profile_id`` (0: the default; driver/gpu.py's for GPUs); None
    when this session cannot count them (Spark Connect on some masters)."""
    return env.slots(profile_id)


# Spark settings that encrypt its *wire* (RPC, block transfer, shuffle fetches). Spark 4's
# security guide: RPC TLS is ``spark.ssl.rpc.enabled`` and is NOT inherited from
# ``spark.ssl.enabled`` (which switches on TLS for the web UIs only); AES-based and SASL
# encryption only take effect together with ``spark.authenticate``, but setting them says
# the user wants an encrypted wire, so they count on their own.
# ``spark.io.encryption.enabled`` encrypts local disk (shuffle files, spills), not the
# wire, and does not count.
WIRE_ENCRYPTION_KEYS = (
    "spark.ssl.rpc.enabled",
    "spark.network.crypto.enabled",
    "spark.authenticate.enableSaslEncryption",
)


def spark_wire_encryption(env: SparkEnv) -> list[str]:
    """The :data:`WIRE_ENCRYPTION_KEYS` set to true in the application's conf. A Spark
    Connect server may refuse to show them: then the gate cannot check, and says so."""
    try:
        return [k for k in WIRE_ENCRYPTION_KEYS if _is_true(env.conf(k, "false"))]
    except Exception as exc:
        if not env.connect:
            raise
        log.warning(
            "cannot read Spark's wire encryption settings through Spark Connect (%s): the "
            'encryption gate is not applied; set encryption = "tls" if Spark encrypts its '
            "wire",
            exc,
        )
        return []


def _is_true(value: object) -> bool:
    return str(value).strip().lower() == "true"


def starts_own_sockets(cfg: TrainConfig) -> bool:
    """Does this job open sparktrain's own sockets (not only Spark's)?

    Every barrier strategy (ring, tree, ps, auto) and every pipeline does: rendezvous,
    metrics, allreduce or parameter-server traffic. ``tree_aggregate`` moves everything
    through Spark's own jobs, except that a ``delta+`` compression spec starts the driver's
    weights server (:mod:`sparktrain.strategies.tree_aggregate.driver_weights`); each
    strategy says which (:meth:`~sparktrain.strategies.base.Strategy.opens_sockets`).
    """
    return cfg.parallelism_pipeline > 1 or registry.get(cfg.strategy).opens_sockets(cfg)


def check_transport_security(
    env: SparkEnv, cfg: TrainConfig, *, served_weights: bool = False
) -> TrainConfig:
    """The encryption gate: when Spark encrypts its wire, sparktrain must not send
    gradients or weights in plaintext. Returns the config the job must run with.

    Only :data:`WIRE_ENCRYPTION_KEYS` count. When one is on and the job opens its own
    sockets (:func:`starts_own_sockets`), the job needs ``encryption = "tls"``, else it is
    refused unless ``allow_unencrypted = true`` (then a warning is logged). Whenever Spark's
    wire encryption is on and the job's sockets would not run TLS (whose records are
    already authenticated), ``frame_integrity`` is forced on, loopback connections too
    (``"auto"`` leaves those plain): the returned config is a copy with
    ``frame_integrity=True`` (``cfg`` itself when nothing changes).
    ``served_weights``: tree_aggregate under Spark Connect found its weights too large for
    a round's closure (known only once the model is built, after the fit's own gate), so
    the driver's weights server sends them: a socket of its own whatever the spec.
    """
    enabled = spark_wire_encryption(env)
    if cfg.comm_backend == "torch":
        check_torch_transport(enabled, cfg, "comm_backend='torch'")
    if not enabled:
        return cfg
    keys = ", ".join(f"{k}=true" for k in enabled)
    if not (served_weights or starts_own_sockets(cfg)):
        log.info(
            "Spark encrypts its wire (%s); tree_aggregate without delta+ uses only Spark's "
            "own transport",
            keys,
        )
        return cfg
    if cfg.encryption == "tls":  # TLS records are authenticated: no frame MACs on top
        return cfg
    if not cfg.allow_unencrypted:
        raise ResourceError(
            f"Spark encrypts its wire here ({keys}), but this job would send gradients and "
            f"weights over sparktrain's own sockets in plaintext (strategy={cfg.strategy!r}"
            f'{_delta_note(cfg, served_weights)}). Set encryption = "tls" to encrypt them (or '
            "allow_unencrypted = true to accept plaintext on a network you trust)"
        )
    log.warning(
        "Spark encrypts its wire (%s) but sparktrain's sockets send plaintext "
        '(allow_unencrypted=true); set encryption = "tls" to encrypt them',
        keys,
    )
    if cfg.frame_integrity is not True:
        log.info("Spark encrypts its wire (%s): frame_integrity is forced on", keys)
        return cfg.replace(frame_integrity=True)
    return cfg


def _delta_note(cfg: TrainConfig, served_weights: bool = False) -> str:
    if served_weights:
        return (
            ": the weights are too large for a Spark Connect round's closure, so the "
            "driver's weights server sends them"
        )
    if registry.get(cfg.strategy).launcher == "rounds" and cfg.parallelism_pipeline == 1:
        return f", compression={cfg.compression!r}: delta+ starts the driver's weights server"
    return ""


SLOT_WAIT_KEY = "spark.scheduler.maxRegisteredResourcesWaitingTime"
"""Spark's own bound on waiting for executors to register; sparktrain's launch check
waits for missing task slots as long as it says (:func:`slot_wait_s`)."""
SLOT_WAIT_DEFAULT_S = 60.0
_TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}
_TIME = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*")


def slot_wait_s(env: SparkEnv) -> float:
    """How long a barrier launch on a cluster waits for missing task slots (executors
    still registering, or replacing lost ones): :data:`SLOT_WAIT_KEY` when the application
    sets it (a Spark time string: ``5s``, ``2min``; a bare number is seconds), else 60 s."""
    value = env.conf(SLOT_WAIT_KEY)
    if value is None:
        return SLOT_WAIT_DEFAULT_S
    match = _TIME.fullmatch(value.lower())
    unit = (match.group(2) or "s") if match else ""
    if match is None or unit not in _TIME_UNITS:
        raise ConfigError(
            f"{SLOT_WAIT_KEY}={value!r} is not a Spark time: write it as a number with a "
            "unit, e.g. 30s or 2min"
        )
    return float(match.group(1)) * _TIME_UNITS[unit]


def check_can_launch(
    env: SparkEnv,
    num_workers: int,
    wait_for_executors_s: float | None = None,
    profile_id: int = 0,
) -> None:
    """Refuse dynamic allocation, and wait (bounded by ``wait_for_executors_s``, default
    :func:`slot_wait_s`) for enough free task slots."""
    if _is_true(env.conf("spark.dynamicAllocation.enabled", "false")):
        raise ResourceError(
            "barrier-mode training cannot run with dynamic allocation: set "
            "spark.dynamicAllocation.enabled=false for this application "
            "(or use strategy='tree_aggregate', which needs no gang scheduling)"
        )
    # In local mode the slots are known at once; on a cluster executors may still register.
    # A Connect client counts configured slots: waiting would not change them.
    waits = env.watches_slots and not env.is_local()
    if waits and wait_for_executors_s is None:
        wait_for_executors_s = slot_wait_s(env)
    deadline = time.monotonic() + ((wait_for_executors_s or 0.0) if waits else 0.0)
    said = False
    while True:
        slots = max_concurrent_tasks(env, profile_id)
        if slots is None:
            log.info(
                "Spark Connect: cannot count the task slots of master %r from the client; "
                "not checked that num_workers=%d tasks can run at once (Spark's own barrier "
                "check fails a stage that cannot, after its retries)",
                env.master,
                num_workers,
            )
            return
        if slots >= num_workers:
            return
        if time.monotonic() >= deadline:
            raise ResourceError(too_few_slots(env, num_workers, slots, profile_id))
        if not said:  # a silent minute reads as a hang
            log.info(
                "num_workers=%d needs %d task slots at once and %s offers %d now: waiting "
                "up to %.0f s for executors (%s sets the wait)",
                num_workers,
                num_workers,
                env.master,
                slots,
                wait_for_executors_s,
                SLOT_WAIT_KEY,
            )
            said = True
        time.sleep(0.5)


def too_few_slots(env: SparkEnv, num_workers: int, slots: int, profile_id: int = 0) -> str:
    """The message for a barrier stage that cannot be gang-scheduled."""
    if profile_id:  # the GPU profile of driver/gpu.py: GPUs may be what is short
        return (
            f"num_workers={num_workers} needs {num_workers} task slots at once with the "
            f"training stage's GPUs (resource profile {profile_id}), but {env.master} offers "
            f"{slots}; lower num_workers or gpus_per_task, or give the executors more GPUs "
            "(spark.executor.resource.gpu.amount) or cores"
        )
    return (
        f"num_workers={num_workers} needs {num_workers} task slots at once, but "
        f"{env.master} offers {slots} (spark.task.cpus={task_cpus(env)}); lower num_workers "
        "or give the application more executor cores"
    )


def is_local(env: SparkEnv) -> bool:
    """``local``/``local[N]``: the slots never change while the application runs."""
    return env.is_local()


class SlotWatchdog:
    """Watches the task slots while a barrier stage is submitted.

    Spark checks a barrier stage's slots once, when its job is submitted. If executors
    are lost after that but before all of the stage's tasks started, the stage waits for
    free slots that never come: a hang (seen on the standalone cluster when a worker
    died while the stage waited for its data). When fewer than ``num_workers`` slots
    remain for ``grace_s`` seconds, the watchdog cancels the job group and keeps
    :attr:`reason`, so the caller can raise :class:`ResourceError` instead. A running
    stage that loses an executor fails by itself first; the grace period lets a lost
    executor be replaced.
    """

    def __init__(
        self,
        env: SparkEnv,
        num_workers: int,
        group: str,
        grace_s: float = 15.0,
        poll_s: float = 1.0,
        profile_id: int = 0,
    ) -> None:
        self.env, self.num_workers, self.group = env, num_workers, group
        self.profile_id = profile_id
        self.grace_s, self.poll_s = grace_s, poll_s
        self.reason: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sparktrain-slots", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        short_since: float | None = None
        while not self._stop.wait(self.poll_s):
            try:
                slots = max_concurrent_tasks(self.env, self.profile_id)
            except Exception:  # the context is stopping: nothing to watch
                return
            if slots is None or slots >= self.num_workers:
                short_since = None
                continue
            now = time.monotonic()
            short_since = now if short_since is None else short_since
            if now - short_since >= self.grace_s:
                self.reason = too_few_slots(self.env, self.num_workers, slots, self.profile_id)
                log.warning("%s: cancelling the training stage", self.reason)
                try:
                    self.env.cancel_group(self.group)
                except Exception as exc:
                    log.warning("could not cancel the training stage: %s", exc)
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
