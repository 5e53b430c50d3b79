"""TrainConfig: the one typed, validated source of every training knob.

A config comes from Python keyword arguments, from a TOML file, or from ``--set key=value``
overrides on the command line; all three go through :meth:`TrainConfig.from_dict`, so an
unknown key or a bad value gets the same error everywhere, naming the key and what it
accepts. Keys are flat; a TOML table ``[t]`` with key ``k`` is the dotted key ``t.k``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

from sparktrain.comm_backend import check_comm_backend
from sparktrain.errors import ConfigError

PS_MODES = ("sync", "async", "ssp")
COMPRESSIONS = ("none", "fp16", "bf16", "int8", "topk:R", "randomk:R", "sign", "powersgd:R")
"""The compressor families; specs compose (``topk:0.01+ef``, ``delta+int8``), see
:mod:`sparktrain.compress.spec` for the grammar."""
LOSSES = ("cross_entropy", "mse", "bce_with_logits")
LINK_PROFILES = ("none", "lan", "5g", "4g", "wan")
"""Named link-emulation profiles; their figures live in :mod:`sparktrain.wire.link`."""
OPTIMIZERS = ("sgd", "adam", "adamw", "adagrad", "sparse_adam")
ENCRYPTIONS = ("none", "tls")
PRECISIONS = ("fp32", "bf16", "fp16")
DEVICES = ("auto", "cpu", "cuda")
COMPRESSION_PATHS = ("auto", "reduce", "allgather", "recompress", "resparsify", "resparsify_tree")
"""``compression_path`` values: the names ``CompressedAllreduce.path`` and the step
statistics use (:mod:`sparktrain.compress.collective`), or ``"auto"``."""
SCHEDULE_INTERVALS = ("step", "epoch")
METRICS = ("accuracy", "top_k:K", "macro_f1", "auc", "log_loss", "rmse", "mae", "r2")
"""Validation metrics by name (``top_k:5``: top-5 accuracy); see ``task/scores.py``."""
EARLY_STOPPING_KEYS = ("metric", "mode", "patience", "min_delta", "restore_best")


@dataclass
class TrainConfig:
    """Every knob of a training run.

    Parameters
    ----------
    strategy:
        How gradients are aggregated: ``"ring"`` (bandwidth-optimal ring allreduce between
        barrier tasks), ``"tree"`` (recursive doubling, for small latency-bound models),
        ``"ps"`` (parameter server in the driver) or ``"tree_aggregate"`` (one ordinary
        Spark job per round, merged with ``RDD.treeAggregate``; no gang scheduling), or
        ``"auto"``: chosen at stage start from a quick latency/bandwidth probe of the links
        and the model size (see :mod:`sparktrain.costmodel`).
    compression:
        Gradient compression spec: ``"none"``, ``"fp16"``, ``"bf16"``, ``"int8"``,
        ``"topk:0.01"``, ``"randomk:0.01"``, ``"sign"``, ``"powersgd:2"``, optionally
        ``delta+`` in front (``ps`` and ``tree_aggregate``: also compress the weights the
        driver sends, as deltas) and ``+ef`` (error feedback) behind, e.g.
        ``"topk:0.01+ef"``;
        grammar and options in :mod:`sparktrain.compress.spec`. ``"auto"`` picks one from
        the link probe. A table ``{"pattern" = "spec", ...}`` is a per-layer policy:
        parameter names are matched against the glob patterns in order, first match wins,
        ``"*"`` is the fallback (unmatched parameters are not compressed).
    compression_path:
        How the ring/tree moves compressed buckets: ``"auto"`` (the path with the fewest
        predicted bytes per rank, ties to the exact all-gather; top-k: the fewest lossy
        re-encodings within twice those bytes), or forced:
        ``"reduce"`` (summable: fp16, bf16, randomk, powersgd), ``"allgather"`` (every
        non-summable spec; ``n - 1`` payloads per rank), ``"recompress"`` (int8, sign on
        the ring), ``"resparsify"`` (top-k with ``+ef`` on the ring: gTop-k, bytes per
        rank flat in the world; on the tree, its log2 rounds) or ``"resparsify_tree"``
        (those rounds on the ring strategy's mesh). A path that does not apply to the
        spec, strategy or world is refused, naming those that do. The summary reports the path taken
        (``compression_path``); see :mod:`sparktrain.compress.collective`.
    comm_backend:
        Whose collectives average the gradients of ``ring`` and ``tree``:
        ``"sparktrain"`` (its own authenticated transport) or ``"torch"``
        (``torch.distributed``'s Gloo on the host buckets, bootstrapped from the
        authenticated rendezvous; compression only as DDP hooks: ``fp16``, ``bf16``,
        ``powersgd:R[+ef]``). torch's store and collectives are neither authenticated nor
        encrypted: opt-in, refused when encryption is required (docs/torch.md).
    overlap:
        Start each bucket's gradient exchange from gradient hooks while the backward pass
        continues (as DDP does), instead of after it.
    shard_optimizer:
        ZeRO-1 for ``ring`` and ``tree``: gradients are reduce-scattered, each rank steps
        the optimizer on its ``1/N`` slice of the parameters (keeping only that slice's
        momentum / Adam moments) and the parameters are all-gathered; the same weights
        as unsharded. Not with compression, ``comm_backend="torch"``, pipelines,
        ``precision="fp16"``, a CUDA device or an optimizer of several parameter groups.
        Checkpoints hold each rank's slice: resume with the same world size.
    sparse_embeddings:
        How embedding tables built with ``sparse=True`` (``nn.Embedding`` /
        ``nn.EmbeddingBag``) exchange their gradients: ``"auto"`` sends only the rows a
        step touched (docs/sparse.md); ``"off"`` densifies them and sends the whole table
        like any other parameter.
    sparse_density:
        The row path's switch to a dense exchange (ring and tree, docs/sparse.md): when
        the rows the ranks touched in a step, summed over the ranks, exceed this
        fraction of a table's rows, that step's rows of the table travel as one dense
        allreduce of the table instead of an allgather of rows. Only the wire changes,
        never the numbers. ``0`` always takes the dense way; the default 0.5 is about
        where the allgather (``n - 1`` messages of the touched rows per rank) sends more
        than the ring's ``2 (n - 1) / n`` of the table.
    link, link_bandwidth_mbit, link_rtt_ms, link_jitter_ms, link_loss:
        Emulate a slow link in sparktrain's own transport (token bucket plus delay; no
        root needed). ``link`` is a profile (``none``, ``lan``, ``5g``, ``4g``, ``wan``) and
        may also be written ``link.profile``; ``link.bandwidth_mbit``, ``link.rtt_ms``,
        ``link.jitter_ms`` and ``link.loss`` (a probability of a lost frame, paid as a
        retransmission delay) override the profile's figures (0 = keep the profile's).
    epochs, batch_size, lr:
        Passes over the data (default 50), samples per worker per step (32), learning
        rate (default 0.001, Adam's usual rate; SGD wants a larger one, e.g. 0.1).
    optimizer, optimizer_kwargs:
        ``"adam"`` (the default: it adapts each weight's step, so one rate suits most
        tables and models untuned), ``"sgd"`` (``momentum``, ``nesterov``,
        ``weight_decay``), ``"adamw"``, ``"adagrad"``, ``"sparse_adam"`` (torch's
        ``SparseAdam``: a model of ``sparse=True`` tables only; docs/sparse.md), or a
        callable ``(params, lr) -> torch.optim.Optimizer``. The defaults were SGD at 0.01
        for 10 epochs before sparktrain 0.2 (docs/migration.md).
    loss, loss_kwargs:
        ``"cross_entropy"``, ``"mse"``, ``"bce_with_logits"`` or a callable
        ``(output, target) -> scalar tensor`` (mean over the batch).
    num_workers:
        Barrier tasks, one training loop each; the data is repartitioned to match.
    seed:
        Seeds model initialisation, shuffling and the validation split.
    comm_timeout:
        Seconds any socket operation may wait before the peer is declared lost.
    bucket_mb:
        Gradients are fused into flat buckets of at most this many MiB per allreduce.
    validation_fraction:
        Fraction of each partition held out for validation when no validation data set
        is given to :meth:`Trainer.fit`.
    threads_per_worker:
        ``torch.set_num_threads`` in each task; 0 means ``spark.task.cpus``.
    device:
        Where each task trains: ``"cpu"``; ``"cuda"`` (the first GPU Spark assigned the
        task, ``TaskContext.resources()["gpu"]``; fails on every rank alike when the task
        has no GPU or CUDA is unavailable); ``"auto"`` (CUDA when the task was given a
        GPU and CUDA is available, else the CPU). See ``docs/gpu.md``.
    gpus_per_task:
        GPUs the training stage asks for per task with a task-level resource profile
        (standalone, local-cluster, YARN, Kubernetes), so stages before it hold none;
        0 asks for none and uses what the application's ``spark.task.resource.gpu.amount``
        gives every task. Under ``local[N]`` (no stage-level scheduling) it is logged and
        ignored; Spark gives local-mode tasks no GPUs, so use ``local-cluster`` on one
        machine (``docs/gpu.md``).
    drop_last:
        Leave out each partition's final short mini-batch every epoch (its rows land in
        full batches in later epochs, as the order is reshuffled). Steps of one to a few
        samples are high-variance; aggressive compressors such as
        ``sign:chunk=32+ef:momentum=0.9`` can diverge on them.
    data_memory_mb:
        Memory, in MiB, a worker may hold its partition's rows in (default 512). A larger
        partition is written once to a memory-mapped Arrow IPC file under the executor's
        local dir (``spark.local.dir``) and read from there every epoch: the same batches,
        the same weights, a flat worker memory (see docs/data.md). ``0`` spills every row.
        Applies to ring, tree and ps; pipelines and tree_aggregate keep their rows in memory.
    prefetch_batches:
        Mini-batches a background thread gathers ahead of the one training (default 2;
        ``0``: gather in the training thread). Changes timing, never values. The thread
        also runs each batch's ``decode`` and ``collate``.
    label_scaling:
        Regression: standardise the (scalar) label with the training rows' mean and
        standard deviation, computed on the driver, so an MSE loss starts near 1 whatever
        the targets' units (targets in the hundreds otherwise make it explode). Validation
        rows are scaled alike, RMSE figures are reported in label units, the training loss
        in standardised units, and ``Trainer.fit`` returns the model wrapped in
        :class:`sparktrain.builders.LabelScaled`, whose outputs are in label units again.
        ``"auto"`` (the default): on for ``loss="mse"`` with one scalar label column of a
        DataFrame under ``Trainer.fit``, off otherwise (``sparktrain.run`` hands the
        labels to your function as they are). ``true`` insists (an error where it cannot
        apply); ``false`` trains on the labels as they are.
    feature_scaling:
        Standardise each input feature with the training rows' mean and standard
        deviation (one aggregation job on the driver; a constant feature keeps a scale of
        1), as MLlib's ``LogisticRegression`` and ``LinearRegression`` do by default
        (``standardization``): features in different units (a count in the thousands
        next to a ratio) then train at one learning rate. Validation rows are scaled
        alike, and ``Trainer.fit`` returns the model wrapped in
        :class:`sparktrain.builders.FeatureScaled`, which takes raw features again.
        ``"auto"`` (the default): on for one numeric features column (a vector or an
        array) of a DataFrame under ``Trainer.fit``, off for several or typed columns,
        RDDs and ``sparktrain.run``. ``true`` insists (an error where it cannot apply);
        ``false`` trains on the features as they are.
    shuffle, shuffle_window:
        Reshuffle each partition every epoch (seeded by ``(seed, rank, epoch)``); with
        ``shuffle_window`` = W > 0, shuffle within windows of W consecutive rows instead
        of over the whole partition (windows in a random order, rows within each in a
        random order): a spilled partition is then read one region at a time. Ring, tree
        and ps; 0 (the default) is a true per-epoch permutation.
    feature_shapes, feature_dtypes, decode, collate:
        Per input column, keyed by the column's name or its model argument (see
        :mod:`sparktrain.data.columns` and docs/data.md): the row's shape
        (``{"image" = [1, 28, 28]}``; ``[-1]``: a variable-length array, padded per batch
        with a mask), the dtype it arrives as (``float32`` (floats' default), ``float64``,
        ``float16``, ``bfloat16``, ``int64`` (integers' default)), a ``"module:function"``
        turning one binary value into an array, and a ``"module:function"`` batching a
        variable-length or binary column's rows (a tensor, or a ``(tensor, mask)`` pair).
        From Python, ``decode`` and ``collate`` also take callables.
    progress, metrics_jsonl:
        Show a live progress bar on the driver; append per-epoch metrics to this file.
    stream_output:
        What the tasks print (``print``, ``sys.stdout``/``sys.stderr`` of a ``train_fn``,
        ``torch_run``'s function or script, a model's code) reaches the driver's own
        ``sys.stdout``/``sys.stderr`` (a notebook's cell), each line as ``[rank r]
        line``, over the job's authenticated channel; capped per task (line length,
        lines and bytes a second), beyond which lines stay in the executor's log only.
        ``false``: the executors' logs only, as before (see docs/torch.md).
    ps_mode, staleness, ps_shards, staleness_lr:
        Parameter server (``strategy="ps"``): ``sync`` | ``async`` | ``ssp`` (a worker may
        run at most ``staleness`` steps ahead of the slowest), the number of shards the
        parameters are split into, and whether a stale gradient's step is scaled by
        1/(1 + staleness).
    encryption, frame_integrity:
        ``encryption = "tls"`` runs sparktrain's sockets over TLS with an ephemeral
        per-job certificate whose fingerprint clients pin (``"none"``: plaintext).
        ``frame_integrity`` puts a MAC keyed from the handshake (AES-GMAC) on every
        frame, so frames cannot be injected, altered, replayed or reordered on the path;
        TLS implies it. ``"auto"`` (the default) decides per connection: MACs on unless
        the connection runs over a loopback address (local mode on 127.0.0.1 stays
        plain, every connection between hosts is authenticated); ``true``/``false`` force
        it on every connection (every side of a job must use the same). The cost is in
        docs/security.md. The Spark-encryption gate turns it on whenever Spark's own
        encryption is on and ``encryption`` is not ``"tls"``.
    driver_services_host, driver_services_ports:
        Where the driver's services (progress channel, rendezvous, state receiver,
        parameter-server shards, weights server, and under Spark Connect the payload
        service for a task too big for the request cap) listen and the executors dial them:
        an address of this process's host (empty: ``spark.driver.host``; under Spark
        Connect, the client's address) and a port range ``"LOW-HIGH"`` to open in a
        firewall (empty: any free port). When the executors cannot reach them, ring and
        tree meet through Spark's barrier ``allGather`` instead and the history arrives
        at the end of the stage (see docs/connect.md); ``ps`` needs them.
    allow_unencrypted:
        Every connection is authenticated (HMAC handshake). When Spark's own wire
        encryption is on and ``encryption`` is ``"none"``, training refuses to start
        unless this is true.
    checkpoint_dir, checkpoint_every, keep_checkpoints, resume, max_restarts:
        Where checkpoints go (a local path or any pyarrow.fs URI; empty = none), how
        often in epochs (fractions allowed, e.g. 0.5), how many to keep, whether to
        continue from the newest intact one, and how often a failed stage is
        resubmitted. With ring/tree on a cluster master (anything but ``local[...]``)
        every executor writes there, so a plain path is refused: use a shared URI
        (``hdfs://``, ``s3://``, ``gs://``, ``abfs://``) or ``file:///path`` for a disk
        every host shares.
    parallelism_pipeline, parallelism_data:
        Keys ``parallelism.pipeline`` (P) and ``parallelism.data`` (D): split the model
        into P pipeline stages, each replicated D times (world size P x D; D = 0 means
        num_workers / P). P = 1 is plain data parallelism. Also ``parallelism.micro_batches``
        per replica step, ``parallelism.schedule`` (``gpipe`` | ``1f1b``),
        ``parallelism.activation_dtype`` on the wire, ``parallelism.balance`` (stages by
        measured ``time`` or ``params``).
    max_param_mb:
        Per-worker parameter-memory cap in MiB (0 = none): data parallelism refuses a
        larger model; with a pipeline every stage must fit.
    aggregation_depth, local_steps:
        ``tree_aggregate``: depth of ``RDD.treeAggregate`` (under Spark Connect: the
        same levels, as grouped DataFrame steps), and local SGD steps per round
        (1 = synchronous mini-batch gradient; k > 1 averages model deltas, FedAvg-style).
    lr_schedule, lr_schedule_kwargs, lr_schedule_interval, warmup_steps:
        A ``torch.optim.lr_scheduler`` class by name (``"CosineAnnealingLR"``,
        ``"StepLR"``, ``"OneCycleLR"``, ``"ReduceLROnPlateau"``, ...; ``"none"``: a
        constant rate) with its keyword arguments, stepped after every optimizer step
        (``"step"``) or every epoch (``"epoch"``). ``CosineAnnealingLR`` without ``T_max``
        and ``OneCycleLR`` without ``total_steps`` span the whole run;
        ``ReduceLROnPlateau`` watches the reported metric ``monitor`` (default
        ``"loss"``) once an epoch. ``warmup_steps`` > 0 ramps the rate linearly from
        ``lr / warmup_steps`` to the schedule's over the first optimizer steps. The
        schedule's state is checkpointed.
    precision:
        ``"fp32"``, ``"bf16"`` (autocast to bfloat16: CPU and GPU) or ``"fp16"`` (autocast
        to float16 with a gradient scaler; meant for CUDA). Parameters and optimizer state
        stay float32.
    fp16_skip_limit:
        Under ``precision="fp16"`` the gradient scaler skips steps whose gradients
        overflow, which is normal; the run stops only after this many consecutive steps
        with a non-finite loss.
    accumulate_steps:
        Mini-batches whose gradients are summed before one exchange and optimizer step:
        the step equals one on a batch ``accumulate_steps`` times larger.
    clip_grad_norm:
        Clip the averaged gradients to this global L2 norm before the step (0 = off);
        every replica clips the same averaged gradients alike.
    divergence_factor:
        Stop with a ``DivergedError`` when an epoch's mean training loss exceeds this many
        times the lowest epoch mean so far, or half the first epoch's mean if that is
        higher (so the default 20 also means at least 10x the first epoch's: a loss
        trained near zero may bump and recover): a run that diverged short of NaN. Every
        rank decides alike on the epoch's exact loss. The built-in loop (``ring``,
        ``tree``, ``ps``) checks; 0 turns the check off. Non-finite losses and weights
        stop a run regardless.
    early_stopping:
        ``{metric = "accuracy", mode = "max", patience = 3, min_delta = 0.0,
        restore_best = false}``: stop when the reported ``metric`` has not improved by more
        than ``min_delta`` for ``patience`` epochs (reports, under ``sparktrain.run``);
        ``mode`` defaults to ``min`` for names containing ``loss``, ``rmse``, ``mae`` or
        ``error`` and ``max`` otherwise. With ``restore_best`` the returned model is the
        best epoch's. Decided on rank 0 and agreed by every rank at the same step.
    metrics:
        Extra validation metrics computed over the whole validation set across ranks
        (exact, not an average of per-rank figures): ``accuracy``, ``top_k:K``,
        ``macro_f1``, ``auc`` (binary), ``log_loss``, ``rmse``, ``mae``, ``r2``, or from
        Python a callable ``(outputs, labels) -> float`` on the gathered set.
    tensorboard_dir, mlflow_tracking_uri, mlflow_experiment:
        Log per-epoch metrics as TensorBoard event files into this directory (extra
        ``sparktrain[tensorboard]``), and the run's parameters, per-epoch metrics and
        final model to this MLflow tracking URI under this experiment (extra
        ``sparktrain[mlflow]``). Empty: off.
    """

    strategy: str = "ring"
    compression: str | dict[str, str] = "none"
    compression_path: str = "auto"
    comm_backend: str = "sparktrain"
    overlap: bool = True
    shard_optimizer: bool = False
    sparse_embeddings: str = "auto"
    sparse_density: float = 0.5
    link_profile: str = "none"
    link_bandwidth_mbit: float = 0.0
    link_rtt_ms: float = 0.0
    link_jitter_ms: float = 0.0
    link_loss: float = 0.0
    epochs: int = 50
    batch_size: int = 32
    lr: float = 0.001
    optimizer: str | Callable[..., Any] = "adam"
    optimizer_kwargs: dict[str, Any] = field(default_factory=dict)
    loss: str | Callable[..., Any] = "cross_entropy"
    loss_kwargs: dict[str, Any] = field(default_factory=dict)
    num_workers: int = 2
    seed: int = 0
    comm_timeout: float = 120.0
    bucket_mb: float = 25.0
    validation_fraction: float = 0.0
    shuffle: bool = True
    drop_last: bool = False
    data_memory_mb: float = 512.0
    prefetch_batches: int = 2
    shuffle_window: int = 0
    label_scaling: bool | str = "auto"
    feature_scaling: bool | str = "auto"
    feature_shapes: dict[str, list[int]] = field(default_factory=dict)
    feature_dtypes: dict[str, str] = field(default_factory=dict)
    decode: dict[str, str | Callable[..., Any]] = field(default_factory=dict)
    collate: dict[str, str | Callable[..., Any]] = field(default_factory=dict)
    threads_per_worker: int = 0
    device: str = "auto"
    gpus_per_task: int = 0
    progress: bool = True
    metrics_jsonl: str = ""
    stream_output: bool = True
    encryption: str = "none"
    frame_integrity: bool | str = "auto"
    allow_unencrypted: bool = False
    driver_services_host: str = ""
    driver_services_ports: str = ""
    checkpoint_dir: str = ""
    checkpoint_every: float = 1.0
    keep_checkpoints: int = 3
    resume: bool = False
    max_restarts: int = 2
    ps_mode: str = "sync"
    staleness: int = 2
    ps_shards: int = 2
    staleness_lr: bool = False
    parallelism_pipeline: int = 1
    parallelism_data: int = 0
    parallelism_micro_batches: int = 4
    parallelism_schedule: str = "1f1b"
    parallelism_activation_dtype: str = "float32"
    parallelism_balance: str = "time"
    max_param_mb: float = 0.0
    aggregation_depth: int = 2
    local_steps: int = 1
    lr_schedule: str = "none"
    lr_schedule_kwargs: dict[str, Any] = field(default_factory=dict)
    lr_schedule_interval: str = "step"
    warmup_steps: int = 0
    precision: str = "fp32"
    fp16_skip_limit: int = 10
    accumulate_steps: int = 1
    clip_grad_norm: float = 0.0
    divergence_factor: float = 20.0
    early_stopping: dict[str, Any] = field(default_factory=dict)
    metrics: list[str | Callable[..., Any]] = field(default_factory=list)
    tensorboard_dir: str = ""
    mlflow_tracking_uri: str = ""
    mlflow_experiment: str = "sparktrain"

    def __post_init__(self) -> None:
        # "true"/"false" as strings (a bool-or-str key keeps strings as given) are bools
        for key in ("frame_integrity", "label_scaling", "feature_scaling"):
            value = getattr(self, key)
            if isinstance(value, str) and value.lower() in ("true", "false", "auto"):
                setattr(self, key, value.lower() == "true" if value.lower() != "auto" else "auto")
        # "Ring" means "ring", as compressor names ignore case
        # the strategies register as their package is imported: with the first config
        from sparktrain.strategies import registry

        self.strategy = registry.canonical(self.strategy)
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first key whose value is not allowed.

        Checks the keys this class owns, alone and together, and that ``strategy`` names
        a strategy there is. What the strategy makes of them (which compression specs it
        takes, whether it has a GPU path or combines with a pipeline) is the plug-in's
        question, asked when a job opens: :func:`sparktrain.driver.job.check_job`.
        """
        from sparktrain.strategies import registry

        registry.check_known(self.strategy)  # the error lists them
        _check_compression(self.compression, self.optimizer_kwargs)
        if isinstance(self.loss, str):
            _one_of("loss", self.loss, LOSSES)
        elif not callable(self.loss):
            raise ConfigError(f"loss must be one of {', '.join(LOSSES)} or a callable")
        if isinstance(self.optimizer, str):
            _one_of("optimizer", self.optimizer, OPTIMIZERS)
        elif not callable(self.optimizer):
            raise ConfigError(f"optimizer must be one of {', '.join(OPTIMIZERS)} or a callable")
        _at_least("epochs", self.epochs, 1)
        _at_least("batch_size", self.batch_size, 1)
        _at_least("num_workers", self.num_workers, 1)
        _at_least("threads_per_worker", self.threads_per_worker, 0)
        _one_of("device", self.device, DEVICES)
        _one_of("compression_path", self.compression_path, COMPRESSION_PATHS)
        _at_least("gpus_per_task", self.gpus_per_task, 0)
        _positive("checkpoint_every", self.checkpoint_every)
        _at_least("keep_checkpoints", self.keep_checkpoints, 1)
        _at_least("max_restarts", self.max_restarts, 0)
        _one_of("encryption", self.encryption, ENCRYPTIONS)
        if not isinstance(self.frame_integrity, bool) and self.frame_integrity != "auto":
            raise ConfigError(
                f'frame_integrity={self.frame_integrity!r} must be true, false or "auto" '
                "(MACs on every connection not over loopback)"
            )
        _one_of("ps_mode", self.ps_mode, PS_MODES)
        _at_least("staleness", self.staleness, 0)
        _at_least("ps_shards", self.ps_shards, 1)
        _at_least("parallelism.pipeline", self.parallelism_pipeline, 1)
        _at_least("parallelism.data", self.parallelism_data, 0)
        _at_least("parallelism.micro_batches", self.parallelism_micro_batches, 1)
        _one_of("parallelism.schedule", self.parallelism_schedule, ("gpipe", "1f1b"))
        _one_of(
            "parallelism.activation_dtype",
            self.parallelism_activation_dtype,
            ("float32", "float16", "bfloat16"),
        )
        _one_of("parallelism.balance", self.parallelism_balance, ("time", "params"))
        if not isinstance(self.max_param_mb, int | float) or self.max_param_mb < 0:
            raise ConfigError(f"max_param_mb={self.max_param_mb!r} must be >= 0 (0 = no cap)")
        _one_of("link.profile", self.link_profile, LINK_PROFILES)
        for key in ("bandwidth_mbit", "rtt_ms", "jitter_ms"):
            value = getattr(self, f"link_{key}")
            if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"link.{key}={value!r} must be a number >= 0 (0 = profile's)")
        if not isinstance(self.link_loss, int | float) or not 0.0 <= self.link_loss < 1.0:
            raise ConfigError(f"link.loss={self.link_loss!r} must be a probability in [0, 1)")
        _at_least("aggregation_depth", self.aggregation_depth, 1)
        _at_least("local_steps", self.local_steps, 1)
        _positive("lr", self.lr)
        _positive("comm_timeout", self.comm_timeout)
        _check_services_address(self.driver_services_host, self.driver_services_ports)
        _positive("bucket_mb", self.bucket_mb)
        if (
            not isinstance(self.data_memory_mb, int | float)
            or isinstance(self.data_memory_mb, bool)
            or not 0 <= self.data_memory_mb < float("inf")
        ):
            raise ConfigError(
                f"data_memory_mb={self.data_memory_mb!r} must be a number of MiB >= 0, e.g. "
                "512 (0 spills every row to local disk)"
            )
        _at_least("prefetch_batches", self.prefetch_batches, 0)
        _at_least("shuffle_window", self.shuffle_window, 0)
        if not 0.0 <= self.validation_fraction < 1.0:
            raise ConfigError(
                f"validation_fraction={self.validation_fraction!r} is out of range: "
                "use a value in [0, 1), e.g. 0.2"
            )
        for name, example in _KWARGS_EXAMPLES.items():
            if not isinstance(getattr(self, name), dict):
                raise ConfigError(f"{name} must be a table/dict, e.g. {name}={example}")
        _check_sgd_settings(self.optimizer, self.optimizer_kwargs)
        _check_column_options(self)
        for key in ("label_scaling", "feature_scaling"):
            if getattr(self, key) not in (True, False, "auto"):
                raise ConfigError(f'{key}={getattr(self, key)!r} must be true, false or "auto"')
        if self.label_scaling is True and isinstance(self.loss, str) and self.loss != "mse":
            raise ConfigError(
                f"label_scaling standardises regression targets; loss={self.loss!r} takes "
                "class labels: set label_scaling=false"
            )
        _check_loop_options(self)
        check_comm_backend(self)
        check_sharding(self)
        if self.sparse_embeddings not in SPARSE_EMBEDDINGS:
            raise ConfigError(
                f"sparse_embeddings={self.sparse_embeddings!r}: choose one of "
                + ", ".join(repr(v) for v in SPARSE_EMBEDDINGS)
            )
        if (
            isinstance(self.sparse_density, bool)
            or not isinstance(self.sparse_density, int | float)
            or not math.isfinite(self.sparse_density)
            or self.sparse_density < 0
        ):
            raise ConfigError(
                f"sparse_density={self.sparse_density!r}: give a finite fraction >= 0 of a "
                "table's rows (e.g. 0.5)"
            )

    # ------------------------------------------------------------------ building
    @classmethod
    def allowed_keys(cls) -> list[str]:
        """Every accepted key, in declaration order; fields of a table are dotted
        (``parallelism.pipeline`` is the field ``parallelism_pipeline``)."""
        return [_dotted(f.name) for f in fields(cls)]

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> TrainConfig:
        """Build from a flat mapping (dotted keys for tables); unknown keys are errors."""
        flat = flatten(values)
        if "link" in flat:  # ``link = "5g"`` is shorthand for ``link.profile = "5g"``
            if "link.profile" in flat:
                raise ConfigError("give the link profile once: 'link' or 'link.profile'")
            flat["link.profile"] = flat.pop("link")
        names = {f.name for f in fields(cls)}
        hints = get_type_hints(cls)
        coerced: dict[str, Any] = {}
        entries: list[tuple[str, str, Any]] = []  # dotted keys into dict-valued settings
        for key, value in flat.items():
            name = key.replace(".", "_") if _dotted(key.replace(".", "_")) == key else key
            if name not in names:
                table, _, entry = key.partition(".")
                if entry and table in names and dict in _allowed_types(hints[table]):
                    entries.append((table, entry, value))
                    continue
                raise ConfigError(
                    f"unknown config key {key!r}; allowed keys: {', '.join(cls.allowed_keys())}"
                )
            coerced[name] = _coerce(key, value, hints[name])
        for table, entry, value in entries:  # after the whole tables they refine
            current = coerced.get(table)  # unset: a table of its own (a default is replaced)
            if current is not None and not isinstance(current, Mapping):
                whole = json.dumps(_set_entry({}, entry.split("."), value), default=str)
                raise ConfigError(
                    f"{table}.{entry} sets an entry of {table}, which is {current!r}, not a "
                    f"table: give the whole table instead, e.g. {table}={whole}"
                )
            coerced[table] = _set_entry(dict(current or {}), entry.split("."), value)
        return cls(**coerced)

    @classmethod
    def from_toml(cls, path: str | Path, overrides: Iterable[str] = ()) -> TrainConfig:
        """Read a TOML file, apply ``key=value`` overrides, validate."""
        return cls.from_dict(apply_overrides(load_toml(path), overrides))

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with some keys changed (validated); the copy was given the keys this
        config was given, and ``changes``."""
        copy = dataclasses.replace(self, **changes)
        object.__setattr__(copy, "_given", self.given_keys | frozenset(changes))
        return copy

    def given_only(self, keys: Iterable[str]) -> TrainConfig:
        """A copy that counts only ``keys`` as given (an estimator's set params, where
        the rest are its defaults)."""
        copy = dataclasses.replace(self)
        object.__setattr__(copy, "_given", frozenset(keys))
        return copy

    @property
    def given_keys(self) -> frozenset[str]:
        """The keys this config was built with (``TrainConfig(...)`` arguments, a TOML
        file's keys, ``--set``), as against the ones left at their defaults: what tells a
        fit which changed defaults it runs on (:func:`changed_defaults_in_effect`)."""
        return getattr(self, "_given", frozenset())  # pickled before keys were recorded

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly view (callables shown by name)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, dict):  # decode/collate tables may hold callables
                value = {k: _callable_name(v) if callable(v) else v for k, v in value.items()}
            elif isinstance(value, list):  # and so may metrics
                value = [_callable_name(v) if callable(v) else v for v in value]
            out[f.name] = value if not callable(value) else _callable_name(value)
        return out


def _remember_given(init: Callable[..., None]) -> Callable[..., None]:
    """The dataclass ``__init__``, recording which keys the caller gave."""

    @functools.wraps(init)
    def __init__(self: TrainConfig, *args: Any, **kwargs: Any) -> None:
        names = [f.name for f in fields(TrainConfig)]
        object.__setattr__(self, "_given", frozenset(names[: len(args)]) | frozenset(kwargs))
        init(self, *args, **kwargs)

    return __init__


TrainConfig.__init__ = _remember_given(TrainConfig.__init__)  # type: ignore[method-assign]


# ---------------------------------------------------------------------- changed defaults
@dataclass(frozen=True)
class ChangedDefault:
    """A key whose default changed: a fit that leaves it unset trains differently than
    it did before ``since``."""

    key: str
    old: Any
    new: Any
    since: str


CHANGED_DEFAULTS = (
    ChangedDefault("optimizer", "sgd", "adam", "0.2"),
    ChangedDefault("lr", 0.01, 0.001, "0.2"),
    ChangedDefault("epochs", 10, 50, "0.2"),
    ChangedDefault("label_scaling", False, "auto", "0.2"),
    ChangedDefault("feature_scaling", False, "auto", "0.2"),
)
"""The defaults that changed, newest last; docs/migration.md says why each."""


def changed_defaults_in_effect(cfg: TrainConfig) -> list[ChangedDefault]:
    """The changed defaults ``cfg`` runs on: keys it was not given that hold their new
    default."""
    return [
        change
        for change in CHANGED_DEFAULTS
        if change.key not in cfg.given_keys
        and getattr(cfg, change.key) == change.new
        and (change.key != "label_scaling" or cfg.loss == "mse")  # "auto" applies to mse only
    ]


def changed_defaults_notice(cfg: TrainConfig) -> str:
    """What a fit on changed defaults says once (empty: it runs on none). A learning rate
    given for the old default optimizer comes first: it is the change most likely to
    hurt (a rate tuned for SGD is usually far too large for Adam)."""
    changes = changed_defaults_in_effect(cfg)
    if not changes:
        return ""
    lines = []
    if any(c.key == "optimizer" for c in changes) and "lr" in cfg.given_keys:
        lines.append(
            f"lr={cfg.lr!r} is given for the default optimizer, which is 'adam' since "
            "sparktrain 0.2 (it was 'sgd'); a rate tuned for SGD is usually too large for "
            "Adam: set optimizer='sgd' to keep SGD."
        )
    olds = ", ".join(f"{c.key}={_toml_value(c.old)}" for c in changes)
    moves = ", ".join(f"{c.key} {_toml_value(c.old)} -> {_toml_value(c.new)}" for c in changes)
    lines.append(
        f"this fit runs on defaults that changed in sparktrain 0.2 ({moves}); set "
        f"{olds} to train as before. docs/migration.md says why."
    )
    return " ".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


_SGD_ONLY = ("momentum", "nesterov", "dampening")


def _check_sgd_settings(optimizer: Any, kwargs: Mapping[str, Any]) -> None:
    """SGD's own keyword arguments with another named optimizer: a config written when
    SGD was the default, most likely."""
    given = [key for key in _SGD_ONLY if key in kwargs]
    if given and isinstance(optimizer, str) and optimizer != "sgd":
        raise ConfigError(
            f"optimizer_kwargs {', '.join(given)} are SGD's settings, which "
            f"optimizer={optimizer!r} does not take; the default optimizer is 'adam' since "
            "sparktrain 0.2 (it was 'sgd'): set optimizer='sgd' to keep SGD (a config "
            f'file: optimizer = "sgd"), or drop {", ".join(given)}'
        )


# ---------------------------------------------------------------------- helpers
def load_toml(path: str | Path) -> dict[str, Any]:
    """Parse a TOML file into a flat dict with dotted keys for tables."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist; see conf/*.toml for examples")
    try:
        with p.open("rb") as fh:
            return flatten(tomllib.load(fh))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p}: not valid TOML: {exc}") from exc


def flatten(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``, except for keys whose value is itself a dict
    (``*_kwargs``, and ``compression`` as a per-layer policy), which stay tables."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and not (name.endswith("_kwargs") or name in _DICT_KEYS):
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = dict(value) if isinstance(value, Mapping) else value
    return out


def _set_entry(table: dict[str, Any], path: list[str], value: Any) -> dict[str, Any]:
    """``table`` with ``value`` at ``path`` (``["momentum"]``; nested tables for more)."""
    head, *rest = path
    if rest:
        inner = table.get(head)
        table[head] = _set_entry(dict(inner) if isinstance(inner, Mapping) else {}, rest, value)
    else:
        table[head] = value
    return table


def apply_overrides(values: Mapping[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Apply ``key=value`` strings; the value is parsed as TOML (so ``1``, ``0.1``,
    ``true``, ``"x"`` and ``{a = 1}`` work), falling back to a bare string."""
    out = dict(values)
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        out[key] = parse_value(raw.strip())
    return out


def parse_value(raw: str) -> Any:
    """Parse one override value as a TOML value, or keep it as a string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw


def _coerce(key: str, value: Any, hint: Any) -> Any:
    """Convert a TOML/CLI value to the field's type, or say what was expected."""
    allowed = _allowed_types(hint)
    if any(isinstance(value, t) and not (t is int and isinstance(value, bool)) for t in allowed):
        return value
    if float in allowed and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if bool in allowed and isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if dict in allowed and isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict):
            return parsed
    if str in allowed and isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    names = " or ".join(t.__name__ for t in allowed if t is not type(None))
    raise ConfigError(f"config key {key!r} expects {names}, got {value!r}")


def _allowed_types(hint: Any) -> tuple[type, ...]:
    origin = get_origin(hint)
    if origin is Union or str(origin) == "<class 'types.UnionType'>":
        out: list[type] = []
        for arg in get_args(hint):
            out.extend(_allowed_types(arg))
        return tuple(out)
    if origin is not None:
        return (origin,) if isinstance(origin, type) and origin.__module__ == "builtins" else ()
    return (hint,) if isinstance(hint, type) else ()


def single_spec(compression: str | Mapping[str, str], strategy: str) -> str:
    """``compression`` as one spec string; a per-layer table is refused with an error that
    says which strategies take one (ring and tree: they bucket gradients by layer; the
    parameter server, tree_aggregate and pipeline stages compress whole shards or
    payloads)."""
    if isinstance(compression, Mapping):
        raise ConfigError(
            "compression is a per-layer table, which only strategy='ring' or 'tree' (without "
            f"a pipeline) accepts; strategy={strategy!r} compresses whole parameter shards or "
            "payloads, not layers: give one spec string, e.g. compression='int8+ef'"
        )
    return compression


def _check_compression(spec: Any, optimizer_kwargs: Any = None) -> None:
    if isinstance(spec, Mapping):
        if not spec:
            raise ConfigError(
                "compression as a per-layer table needs at least one 'pattern = spec' entry, "
                'e.g. compression={"fc3.*": "fp16", "*": "int8+ef"}'
            )
        for pattern, sub in spec.items():
            if not isinstance(pattern, str) or not isinstance(sub, str) or sub == "auto":
                raise ConfigError(
                    f"compression table entry {pattern!r} = {sub!r}: each entry maps a "
                    "parameter-name glob to a spec string such as 'int8+ef' ('auto' is "
                    "only allowed for the whole model)"
                )
            _check_compression(sub, optimizer_kwargs)
        return
    if not isinstance(spec, str):
        raise ConfigError(f"compression must be a spec string such as 'topk:0.01+ef', got {spec!r}")
    if spec == "auto":
        return
    from sparktrain.compress.registry import build

    comp = build(spec)
    optimizer_momentum = (
        float(optimizer_kwargs.get("momentum", 0.0) or 0.0)
        if isinstance(optimizer_kwargs, dict)
        else 0.0
    )
    if getattr(comp, "momentum", 0.0) and optimizer_momentum > 0.0:
        raise ConfigError(
            f"compression={spec!r} applies momentum before compressing (DGC momentum "
            "correction), so the optimizer must not apply it again: set "
            "optimizer_kwargs.momentum=0 (or drop momentum= from the spec)"
        )


# The example of a dict-valued setting's error: Python, and after --set as JSON.
_KWARGS_EXAMPLES = {
    "optimizer_kwargs": '{"weight_decay": 0.0001}',
    "loss_kwargs": '{"label_smoothing": 0.1}',
}

# Fields that live in a TOML table: the table name, then the key.
_TABLES = ("parallelism", "link")
# Keys whose value may itself be a table (kept whole, not flattened into dotted keys).
_DICT_KEYS = (
    "compression",
    "feature_shapes",
    "feature_dtypes",
    "decode",
    "collate",
    "early_stopping",
)


def _check_loop_options(cfg: TrainConfig) -> None:
    """The loop's schedule, precision, accumulation, clipping, early stopping, metrics."""
    name = cfg.lr_schedule
    if name != "none":
        import torch.optim.lr_scheduler as schedulers  # only when a schedule is named

        def is_schedule(n: object) -> bool:
            cls = getattr(schedulers, n, None) if isinstance(n, str) else None
            return (
                isinstance(cls, type)
                and n not in _NOT_SCHEDULES
                and hasattr(cls, "step")
                and hasattr(cls, "state_dict")
            )

        if not is_schedule(name):
            known = sorted(n for n in dir(schedulers) if is_schedule(n))
            raise ConfigError(
                f"lr_schedule={name!r} is not a torch.optim.lr_scheduler class; use 'none' or "
                f"one of {', '.join(known)}"
            )
    if not isinstance(cfg.lr_schedule_kwargs, dict):
        raise ConfigError(
            'lr_schedule_kwargs must be a table/dict, e.g. lr_schedule_kwargs={"T_max": 1000}'
        )
    _one_of("lr_schedule_interval", cfg.lr_schedule_interval, SCHEDULE_INTERVALS)
    _at_least("warmup_steps", cfg.warmup_steps, 0)
    _one_of("precision", cfg.precision, PRECISIONS)
    _at_least("fp16_skip_limit", cfg.fp16_skip_limit, 1)
    _at_least("accumulate_steps", cfg.accumulate_steps, 1)
    value = cfg.clip_grad_norm
    if not isinstance(value, int | float) or isinstance(value, bool) or not value >= 0:
        raise ConfigError(f"clip_grad_norm={value!r} must be a number >= 0 (0 = no clipping)")
    value = cfg.divergence_factor
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or not (value == 0 or value > 1)
    ):
        raise ConfigError(
            f"divergence_factor={value!r} must be 0 (off) or a number > 1, e.g. 20: the "
            "growth of the epoch's mean loss over the lowest so far that stops a run"
        )
    _check_early_stopping(cfg.early_stopping)
    if not isinstance(cfg.metrics, list):
        raise ConfigError(
            f'metrics must be a list, e.g. metrics=["macro_f1", "top_k:3"]; got {cfg.metrics!r}'
        )
    for metric in cfg.metrics:
        check_metric_name(metric)
    for key in ("tensorboard_dir", "mlflow_tracking_uri", "mlflow_experiment"):
        if not isinstance(getattr(cfg, key), str):
            raise ConfigError(f"{key} must be a string")


# torch.optim.lr_scheduler's names that are not schedules a run can name on its own
_NOT_SCHEDULES = (
    "LRScheduler",
    "_LRScheduler",
    "SequentialLR",
    "ChainedScheduler",
    "Optimizer",
    # these take a Python function, which neither TOML nor a Param can hold
    "LambdaLR",
    "MultiplicativeLR",
)


def check_metric_name(metric: Any) -> None:
    """A validation metric by name (``top_k:K`` with an integer K >= 1) or a callable."""
    if callable(metric):
        return
    if isinstance(metric, str):
        if metric in METRICS and metric != "top_k:K":
            return
        head, sep, k = metric.partition(":")
        if head == "top_k" and sep and k.isdigit() and int(k) >= 1:
            return
    raise ConfigError(
        f"metrics: {metric!r} is not a metric; use one of {', '.join(METRICS)} (e.g. "
        "'top_k:5') or, from Python, a callable (outputs, labels) -> float"
    )


def _check_early_stopping(table: Any) -> None:
    if not isinstance(table, dict):
        raise ConfigError(
            "early_stopping must be a table, e.g. "
            'early_stopping={"metric": "accuracy", "patience": 3}'
        )
    if not table:
        return
    unknown = sorted(set(table) - set(EARLY_STOPPING_KEYS))
    if unknown:
        raise ConfigError(
            f"early_stopping: unknown key(s) {', '.join(unknown)}; allowed: "
            f"{', '.join(EARLY_STOPPING_KEYS)}"
        )
    if not isinstance(table.get("metric"), str) or not table["metric"]:
        raise ConfigError(
            'early_stopping needs the metric to watch, e.g. early_stopping={"metric": '
            '"accuracy"} (any name '
            "the run reports: loss, the validation metric, a metrics entry, or a report key)"
        )
    if table.get("mode", "min") not in ("min", "max"):
        raise ConfigError(f"early_stopping.mode={table['mode']!r} must be 'min' or 'max'")
    _at_least("early_stopping.patience", table.get("patience", 1), 1)
    delta = table.get("min_delta", 0.0)
    if not isinstance(delta, int | float) or isinstance(delta, bool) or delta < 0:
        raise ConfigError(f"early_stopping.min_delta={delta!r} must be a number >= 0")
    if not isinstance(table.get("restore_best", False), bool):
        raise ConfigError("early_stopping.restore_best must be true or false")


def _check_column_options(cfg: TrainConfig) -> None:
    """The per-column tables: shapes and dtypes checked here, hooks by form (they are
    imported where they run, on the workers and the driver's model check)."""
    from sparktrain.data.columns import check_dtype, check_shape

    # as Python and after --set alike (a value TOML cannot parse is read as JSON)
    examples = {
        "feature_shapes": 'feature_shapes={"image": [1, 28, 28]}',
        "feature_dtypes": 'feature_dtypes={"x": "float64"}',
        "decode": 'decode={"image": "mypkg.io:decode_png"}',
        "collate": 'collate={"tokens": "mypkg.io:pack"}',
    }
    for name, example in examples.items():
        table = getattr(cfg, name)
        if not isinstance(table, dict):
            raise ConfigError(f"{name} must be a table of column -> value, e.g. {example}")
        for column, value in table.items():
            if name == "feature_shapes":
                check_shape(column, value)
            elif name == "feature_dtypes":
                check_dtype(column, value)
            elif not (callable(value) or (isinstance(value, str) and ":" in value)):
                raise ConfigError(
                    f"{name}[{column!r}] = {value!r}: give 'package.module:function' (or, from "
                    f"Python, a callable), e.g. {example}"
                )


def _dotted(name: str) -> str:
    for table in _TABLES:
        if name.startswith(f"{table}_"):
            return f"{table}.{name.removeprefix(table + '_')}"
    return name


def _one_of(key: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not supported; allowed values: {', '.join(allowed)}")


def _at_least(key: str, value: Any, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f"{key}={value!r} must be an integer >= {low}")


def _positive(key: str, value: Any) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
        raise ConfigError(f"{key}={value!r} must be a number > 0")


def _callable_name(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


def parse_port_range(text: str) -> tuple[int, int] | None:
    """``"LOW-HIGH"`` (or one port) as a pair; ``""``: None (any free port)."""
    if not text:
        return None
    low, sep, high = str(text).partition("-")
    try:
        first, last = int(low), int(high if sep else low)
    except ValueError:
        first, last = 0, -1
    if not 1024 <= first <= last <= 65535:
        raise ConfigError(
            f"driver_services_ports={text!r}: give a range of unprivileged ports "
            "'LOW-HIGH' within 1024-65535, e.g. '40000-40099', or '' for any free port"
        )
    return first, last


def _check_services_address(host: str, ports: str) -> None:
    if not isinstance(host, str) or host.strip() in ("0.0.0.0", "::", "[::]", "*"):
        raise ConfigError(
            f"driver_services_host={host!r}: give an address of this host that the "
            "executors can reach (never a wildcard), or '' for spark.driver.host"
        )
    if not isinstance(ports, str):
        raise ConfigError(f"driver_services_ports={ports!r}: give a string 'LOW-HIGH'")
    parse_port_range(ports)


SPARSE_EMBEDDINGS = ("auto", "off")


def check_sharding(cfg: TrainConfig) -> None:
    """Raise ConfigError for the combinations ``shard_optimizer`` does not support."""
    if not isinstance(cfg.shard_optimizer, bool):
        raise ConfigError(f"shard_optimizer={cfg.shard_optimizer!r} must be true or false")
    if not cfg.shard_optimizer:
        return
    if cfg.compression != "none":
        raise ConfigError(
            "shard_optimizer=true reduce-scatters uncompressed gradients: set compression='none'"
        )
    if cfg.comm_backend != "sparktrain":
        raise ConfigError(
            "shard_optimizer=true needs comm_backend='sparktrain' (the ring's reduce-scatter "
            "and all-gather halves)"
        )
    if cfg.parallelism_pipeline > 1:
        raise ConfigError("shard_optimizer=true does not combine with parallelism.pipeline > 1")
    if cfg.precision == "fp16":
        raise ConfigError(
            "shard_optimizer=true does not support precision='fp16' (the loss scaler checks "
            "the whole model's gradients): use 'bf16' or 'fp32'"
        )
    if cfg.device == "cuda":
        raise ConfigError("shard_optimizer=true steps on the CPU: use device='cpu' or 'auto'")
