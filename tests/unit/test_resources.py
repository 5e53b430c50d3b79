import dataclasses
import logging

import pytest

from sparktrain.config import TrainConfig
from sparktrain.driver.resources import (
    SLOT_WAIT_KEY,
    check_can_launch,
    check_transport_security,
    slot_wait_s,
)
from sparktrain.driver.spark_env import ClassicEnv
from sparktrain.errors import ConfigError, ResourceError
from sparktrain.trainer import Trainer


class _Conf(dict):
    def get(self, key, default=None):
        return super().get(key, default)


class _FakeContext:
    master = "local[2]"

    def __init__(self, **conf):
        self._conf = _Conf(conf)

    def getConf(self):
        return self._conf


def _env(**conf: str) -> ClassicEnv:
    return ClassicEnv(_FakeContext(**conf))  # type: ignore[arg-type]


def test_dynamic_allocation_is_refused_with_a_way_out():
    env = _env(**{"spark.dynamicAllocation.enabled": "true"})
    with pytest.raises(ResourceError, match="spark.dynamicAllocation.enabled=false"):
        check_can_launch(env, 2)


# ------------------------------------------------------------------ the encryption gate
WIRE_KEYS = (
    "spark.ssl.rpc.enabled",
    "spark.network.crypto.enabled",
    "spark.authenticate.enableSaslEncryption",
)
# every path that opens sparktrain's own sockets
SOCKET_CONFIGS = {
    "ring": {"strategy": "ring"},
    "tree": {"strategy": "tree"},
    "ps": {"strategy": "ps"},
    "auto": {"strategy": "auto"},
    "pipeline": {"strategy": "ring", "parallelism_pipeline": 2},
    "tree_aggregate+delta": {"strategy": "tree_aggregate", "compression": "delta+int8"},
}


def _encrypted(key: str = "spark.ssl.rpc.enabled", **more: str) -> ClassicEnv:
    return _env(**{key: "true"}, **more)


@pytest.mark.parametrize("key", WIRE_KEYS)
@pytest.mark.parametrize("path", sorted(SOCKET_CONFIGS))
def test_spark_wire_encryption_refuses_plaintext_sockets_on_every_path(key, path):
    cfg = TrainConfig(**SOCKET_CONFIGS[path])
    with pytest.raises(ResourceError) as err:
        check_transport_security(_encrypted(key), cfg)
    text = str(err.value)
    assert f"{key}=true" in text
    assert 'Set encryption = "tls"' in text and "allow_unencrypted = true" in text
    assert "use strategy='tree_aggregate'" not in text  # no longer sold as "encrypted"


@pytest.mark.parametrize("path", sorted(SOCKET_CONFIGS))
def test_tls_passes_the_gate_and_allow_unencrypted_warns(path, caplog):
    sc = _encrypted("spark.network.crypto.enabled")
    tls = TrainConfig(encryption="tls", **SOCKET_CONFIGS[path])
    assert check_transport_security(sc, tls) is tls
    assert "plaintext" not in caplog.text
    plain = TrainConfig(allow_unencrypted=True, **SOCKET_CONFIGS[path])
    out = check_transport_security(sc, plain)
    assert out == dataclasses.replace(plain, frame_integrity=True)
    assert "sparktrain's sockets send plaintext" in caplog.text


@pytest.mark.parametrize(
    "conf",
    [
        {"spark.io.encryption.enabled": "true"},  # local disk, not the wire
        {"spark.ssl.enabled": "true"},  # the web UIs; RPC TLS is not inherited from it
        {"spark.ssl.enabled": "true", "spark.ssl.rpc.enabled": "false"},
        {"spark.network.crypto.enabled": "false"},
        {},
    ],
)
def test_settings_that_do_not_encrypt_the_wire_do_not_trigger_the_gate(conf):
    cfg = TrainConfig(strategy="ring", frame_integrity=False)
    assert check_transport_security(_env(**conf), cfg) is cfg


def test_conf_booleans_are_case_insensitive_as_in_spark():
    env = _env(**{"spark.network.crypto.enabled": "True"})
    with pytest.raises(ResourceError):
        check_transport_security(env, TrainConfig())


@pytest.mark.parametrize("compression", ["none", "int8", "topk:0.01+ef"])
def test_tree_aggregate_without_delta_uses_only_sparks_transport(compression, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="sparktrain.driver.resources")
    cfg = TrainConfig(strategy="tree_aggregate", compression=compression)
    out = check_transport_security(_encrypted(), cfg)
    assert out == cfg
    assert "tree_aggregate without delta+ uses only Spark's own transport" in caplog.text


def test_tree_aggregate_with_delta_names_the_weights_server():
    cfg = TrainConfig(strategy="tree_aggregate", compression="delta+fp16")
    with pytest.raises(ResourceError, match="delta\\+ starts the driver's weights server"):
        check_transport_security(_encrypted(), cfg)


@pytest.mark.parametrize("path", sorted(SOCKET_CONFIGS))
def test_spark_encryption_forces_frame_integrity_on_a_copy(path):
    cfg = TrainConfig(allow_unencrypted=True, frame_integrity=False, **SOCKET_CONFIGS[path])
    out = check_transport_security(_encrypted(), cfg)
    assert out.frame_integrity is True and out.encryption == "none"
    assert cfg.frame_integrity is False  # the caller's config is left alone
    assert dataclasses.replace(out, frame_integrity=False) == cfg


def test_tls_needs_no_frame_macs_on_top():
    """TLS records are authenticated already: a MAC per frame would only cost busbw."""
    cfg = TrainConfig(encryption="tls", frame_integrity=False)
    assert check_transport_security(_encrypted(), cfg) is cfg


# ------------------------------------------------------------------ the gate in Trainer.fit
class _FakeSession:
    def __init__(self, env: ClassicEnv) -> None:
        self.sparkContext = env.sc


@pytest.mark.parametrize("path", sorted(SOCKET_CONFIGS))
def test_trainer_fit_runs_the_gate_on_every_path(path):
    """Refused before any Spark job (the fake context would fail on the first one)."""
    cfg = TrainConfig(**SOCKET_CONFIGS[path])
    trainer = Trainer("sparktrain.models:digits_mlp", cfg, spark=_FakeSession(_encrypted()))  # type: ignore[arg-type]
    with pytest.raises(ResourceError, match="spark.ssl.rpc.enabled=true"):
        trainer.fit(None)


def test_trainer_fit_runs_the_job_with_frame_integrity_forced_on(monkeypatch):
    seen: list[TrainConfig] = []

    def fake_fit(self, sc, started, *args):  # type: ignore[no-untyped-def]
        seen.append(self.config)
        return "result"

    monkeypatch.setattr(Trainer, "_fit", fake_fit)
    # the fake context has no slots to count
    monkeypatch.setattr("sparktrain.driver.job.check_can_launch", lambda env, workers: None)
    cfg = TrainConfig(strategy="ring", allow_unencrypted=True, frame_integrity=False)
    trainer = Trainer("sparktrain.models:digits_mlp", cfg, spark=_FakeSession(_encrypted()))  # type: ignore[arg-type]
    assert trainer.fit(None) == "result"
    assert seen[0].frame_integrity is True and trainer.config is cfg and not cfg.frame_integrity
    plain = Trainer("sparktrain.models:digits_mlp", cfg, spark=_FakeSession(_env()))  # type: ignore[arg-type]
    plain.fit(None)
    assert seen[1] is cfg  # no Spark encryption: the caller's config, unchanged


# ------------------------------------------------------------------ the slot watchdog
class _Cancellable:
    master = "spark://127.0.0.1:7077"

    def __init__(self) -> None:
        self.cancelled: list[str] = []

    def getConf(self) -> _Conf:
        return _Conf({})

    def cancelJobGroup(self, group: str) -> None:
        self.cancelled.append(group)


def test_the_watchdog_cancels_a_stage_that_lost_its_slots(monkeypatch):
    import time

    from sparktrain.driver import resources

    monkeypatch.setattr(resources, "max_concurrent_tasks", lambda env, profile_id=0: 1)
    sc = _Cancellable()
    started = time.monotonic()
    dog = resources.SlotWatchdog(ClassicEnv(sc), 2, "grp", grace_s=0.3, poll_s=0.05)  # type: ignore[arg-type]
    while not sc.cancelled and time.monotonic() - started < 10:
        time.sleep(0.05)
    dog.stop()
    assert sc.cancelled == ["grp"]
    assert dog.reason is not None and "num_workers=2 needs 2 task slots" in dog.reason
    assert "offers 1" in dog.reason


def test_the_watchdog_waits_out_a_short_loss_and_leaves_a_full_cluster_alone(monkeypatch):
    import time

    from sparktrain.driver import resources

    seen = iter([1, 1, 2] + [2] * 1000)  # one executor briefly gone, then replaced
    monkeypatch.setattr(resources, "max_concurrent_tasks", lambda env, profile_id=0: next(seen))
    sc = _Cancellable()
    dog = resources.SlotWatchdog(ClassicEnv(sc), 2, "grp", grace_s=0.5, poll_s=0.05)  # type: ignore[arg-type]
    time.sleep(1.0)
    dog.stop()
    assert sc.cancelled == [] and dog.reason is None


def test_weights_served_to_connect_tasks_pass_the_gate_like_any_socket():
    """tree_aggregate under Connect with weights over the closure share: the weights
    server is a socket of its own even without delta+."""
    cfg = TrainConfig(strategy="tree_aggregate")
    with pytest.raises(ResourceError, match="too large for a Spark Connect round's closure"):
        check_transport_security(_encrypted(), cfg, served_weights=True)
    plain = TrainConfig(strategy="tree_aggregate", allow_unencrypted=True)
    out = check_transport_security(_encrypted(), plain, served_weights=True)
    assert out == dataclasses.replace(plain, frame_integrity=True)
    assert check_transport_security(_env(), cfg, served_weights=True) is cfg  # no encryption


# ------------------------------------------------------------------ the wait for slots
@pytest.mark.parametrize(
    ("value", "seconds"),
    [(None, 60.0), ("5s", 5.0), ("2min", 120.0), ("1500ms", 1.5), ("45", 45.0), (" 1h ", 3600.0)],
)
def test_the_wait_for_slots_is_sparks_own_setting(value: str | None, seconds: float) -> None:
    conf = {} if value is None else {SLOT_WAIT_KEY: value}
    assert slot_wait_s(_env(**conf)) == seconds


def test_a_wait_that_is_not_a_spark_time_says_how_to_write_it() -> None:
    env = _env(**{SLOT_WAIT_KEY: "soon"})
    with pytest.raises(ConfigError, match=r"not a Spark time: write it as .* 30s or 2min"):
        slot_wait_s(env)


class _ShortCluster(ClassicEnv):
    """A cluster (not local) that offers one slot and never more."""

    master = "spark://127.0.0.1:7077"

    def __init__(self, **conf: str) -> None:
        super().__init__(_FakeContext(**conf))  # type: ignore[arg-type]

    def is_local(self) -> bool:
        return False

    def slots(self, profile_id: int = 0) -> int | None:
        return 1


def test_a_cluster_short_of_slots_says_it_waits_then_fails_after_sparks_wait(caplog) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.INFO, logger="sparktrain.driver.resources")
    env = _ShortCluster(**{SLOT_WAIT_KEY: "100ms"})
    with pytest.raises(ResourceError, match="offers 1"):
        check_can_launch(env, 2)
    said = [r.getMessage() for r in caplog.records if "waiting up to" in r.getMessage()]
    assert len(said) == 1, said
    assert SLOT_WAIT_KEY in said[0] and "offers 1 now" in said[0]
