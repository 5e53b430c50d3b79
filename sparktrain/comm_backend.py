"""``comm_backend``: whose collectives average the ring/tree strategies' gradients.

``"sparktrain"`` (the default) is sparktrain's own transport (authenticated, optionally
TLS). ``"torch"`` runs them through ``torch.distributed`` (Gloo: the buckets are host memory),
bootstrapped from sparktrain's authenticated rendezvous
(:mod:`sparktrain.strategies.allreduce.task_torch`); torch's store and collectives are neither
authenticated nor encrypted, so it is opt-in and refused when encryption is required.

Both torch paths (``comm_backend = "torch"`` and ``torch_run``) start rank 0's
``TCPStore`` with :func:`bound_store`: on the task's own address, never on every interface.

This module imports no torch at module level: :class:`~sparktrain.config.TrainConfig`
validates with it.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sparktrain.errors import ConfigError, ResourceError

if TYPE_CHECKING:
    from torch.distributed import TCPStore

    from sparktrain.config import TrainConfig

log = logging.getLogger(__name__)

COMM_BACKENDS = ("sparktrain", "torch")
TORCH_SPECS = ("none", "fp16", "bf16", "powersgd:R", "powersgd:R+ef", "powersgd:R,cold+ef")
"""The compression specs ``comm_backend="torch"`` runs as DDP communication hooks."""


@dataclass(frozen=True)
class HookSpec:
    """A compression spec as one of torch's DDP communication hooks (the compressor's
    own answer: :attr:`~sparktrain.compress.base.BaseCompressor.ddp_hook`)."""

    hook: str  # "fp16", "bf16" or "powersgd"
    rank: int = 1
    warm_start: bool = True
    error_feedback: bool = False


def hook_spec(spec: str) -> HookSpec | None:
    """The DDP hook for ``spec`` (None: ``"none"``, the plain allreduce); a
    :class:`ConfigError` for a spec torch has no hook for."""
    from sparktrain.compress.feedback import ErrorFeedback
    from sparktrain.compress.registry import build

    comp = build(spec)
    if comp is None:
        return None
    ef = comp if isinstance(comp, ErrorFeedback) else None
    core = comp if ef is None else ef.inner
    hook = getattr(core, "ddp_hook", None)
    if ef is not None and not (ef.plain and getattr(core, "ddp_hook_feedback", False)):
        hook = None
    if hook is None:
        raise ConfigError(
            f"comm_backend='torch' compresses with torch's DDP communication hooks, which "
            f"have no counterpart for compression={spec!r}: use one of "
            f"{', '.join(TORCH_SPECS)}, or comm_backend='sparktrain' for every compressor"
        )
    options: dict[str, Any] = getattr(core, "ddp_hook_options", dict)()
    return HookSpec(hook, error_feedback=ef is not None, **options)


def check_comm_backend(cfg: TrainConfig) -> None:
    """Validate ``comm_backend`` and what it combines with."""
    if cfg.comm_backend not in COMM_BACKENDS:
        raise ConfigError(
            f"comm_backend={cfg.comm_backend!r} is not allowed; allowed values: "
            f"{', '.join(COMM_BACKENDS)}"
        )
    if cfg.comm_backend == "sparktrain":
        return
    if cfg.encryption != "none":
        raise ConfigError(
            "comm_backend='torch' sends through torch.distributed, whose store and "
            f"Gloo/NCCL traffic are neither authenticated nor encrypted: it cannot honour "
            f"encryption={cfg.encryption!r} (use comm_backend='sparktrain')"
        )
    compression = cfg.compression
    specs = compression.values() if isinstance(compression, Mapping) else [compression]
    for spec in specs:
        hook_spec(spec)


def check_torch_transport(enabled: Sequence[str], cfg: TrainConfig, what: str) -> None:
    """Refuse ``what`` (torch_run, or ``comm_backend="torch"``) when encryption is
    required: torch's TCPStore, Gloo and NCCL authenticate and encrypt nothing.

    Required means ``encryption = "tls"``, or Spark encrypting its wire (``enabled``:
    the :data:`~sparktrain.driver.resources.WIRE_ENCRYPTION_KEYS` set, from
    :func:`~sparktrain.driver.resources.spark_wire_encryption`) without
    ``allow_unencrypted = true``, the same opt-out the encryption gate takes.
    """
    if cfg.encryption != "none":
        raise ResourceError(
            f"{what} runs the collectives through torch.distributed, whose store and "
            f"Gloo/NCCL traffic are neither authenticated nor encrypted, so it cannot honour "
            f'encryption = "{cfg.encryption}": train with sparktrain\'s own collectives '
            '(sparktrain.run, Trainer.fit), which encrypt, or set encryption = "none" on a '
            "network you trust"
        )
    if not enabled:
        return
    keys = ", ".join(f"{k}=true" for k in enabled)
    if not cfg.allow_unencrypted:
        raise ResourceError(
            f"Spark encrypts its wire here ({keys}), but {what} sends through "
            "torch.distributed, which neither authenticates nor encrypts (its TCPStore "
            'and Gloo/NCCL): use sparktrain\'s own collectives with encryption = "tls", '
            "or set allow_unencrypted = true to accept plaintext on a network you trust"
        )
    log.warning(
        "Spark encrypts its wire (%s) but %s sends through torch.distributed in plaintext "
        "and without authentication (allow_unencrypted=true)",
        keys,
        what,
    )


def bound_store(host: str, world_size: int, timeout: datetime.timedelta) -> TCPStore:
    """Rank 0's ``torch.distributed.TCPStore`` server, listening on ``host`` only.

    Given a host and port alone, torch's store server binds every interface (``*:port``,
    both its libuv and its classic backend); handed a listening socket
    (``master_listen_fd``) it serves on that one instead. So the socket is opened here,
    on the task's own address (:func:`~sparktrain.wire.listen.open_listener`, which
    refuses wildcards), on a port the OS picks: ``store.port``. The store owns the
    descriptor from then on and closes it when it is destroyed.
    ``wait_for_workers=False``: the others connect once the port reaches them.
    """
    import torch.distributed as dist

    from sparktrain.wire.listen import open_listener

    listener = open_listener(host, 0)
    listener.settimeout(None)  # blocking: torch polls and accepts on it itself
    port = int(listener.getsockname()[1])
    # Handed over, not closed here even if the store fails to start: torch may have
    # closed it already, and closing a descriptor number twice can hit another file.
    fd = listener.detach()
    return dist.TCPStore(
        host,
        port,
        world_size,
        is_master=True,
        timeout=timeout,
        wait_for_workers=False,
        master_listen_fd=fd,
    )
