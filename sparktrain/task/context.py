"""What a worker knows about its job and its peers; no Spark types here.

`driver/barrier.py` builds a :class:`WorkerContext` from Spark's ``BarrierTaskContext``;
tests build one from threads. Executor-side code sees only this.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sparktrain.config import TrainConfig
from sparktrain.data.columns import Layout
from sparktrain.strategies import registry
from sparktrain.task.faults import FaultPlan
from sparktrain.wire.frames import MAX_FRAME_BYTES_DEFAULT
from sparktrain.wire.security import WireSecurity

if TYPE_CHECKING:
    from sparktrain.strategies.base import Strategy


@dataclass(frozen=True)
class JobSpec:
    """The picklable view of a job that travels from the driver to every task.

    Holds no SparkSession, socket or lock: only plain values and factories (the model's,
    the plug-in compressors').
    """

    job_id: str
    attempt: int
    secret: bytes = field(repr=False)
    config: TrainConfig
    model_fn: Any  # zero-argument callable or "package.module:function"
    model_kwargs: dict[str, Any]
    feature_width: int
    num_outputs: int
    metrics_address: str | None = None
    rendezvous_address: str | None = None  # the driver's all-gather (driver/services/rendezvous.py)
    threads: int = 1
    state_chunk_bytes: int = 4 << 20
    # rank 0 streams its trained state here (driver/services/state_receiver.py) when set; without
    # it the state returns as chunked task results (thread harnesses, benchmarks)
    state_address: str | None = None
    # cap on one frame between ranks; every transfer is chunked below it (tests shrink it)
    max_frame_bytes: int = MAX_FRAME_BYTES_DEFAULT
    ps_addresses: tuple[str, ...] = ()  # one "host:port" per parameter-server shard
    resume_step: int | None = None  # continue from the checkpoint of this step
    resume_history: tuple[dict[str, Any], ...] = ()  # epochs done before resume_step (PS)
    fault: FaultPlan | None = None  # test-only failure injection
    # frame MACs / TLS certificate of every connection (None: plaintext, no MACs)
    security: WireSecurity | None = field(default=None, repr=False)
    # the strategy plug-in, unpickled in the task by reference to its module (None: the
    # one registered under config.strategy)
    strategy: Strategy | None = None
    # the model's input columns (None: one float32 features column of feature_width)
    layout: Layout | None = None
    # the label_scaling std (1: labels as they are): metrics back in label units
    label_scale: float = 1.0
    # sparktrain.run: the user's train_fn (a callable or "package.module:function")
    train_fn: Any = None
    # sparktrain.run under ps: where rank 0 describes the model to start the server
    ps_bootstrap: str | None = None
    # the compressors the driver registered beyond the built-ins, {name: factory}
    # (compress.registry.plugins()), pickled as the strategy is; the task installs them
    # (compress.registry.install) before it builds any compressor
    compressors: dict[str, Any] = field(default_factory=dict)
    # the tasks' own output also stays on the executor's streams (its log); False in
    # local mode, where those streams are the driver's terminal (task/output.py)
    echo_output: bool = True

    @property
    def data_layout(self) -> Layout:
        """How the task's Arrow columns become the model's inputs."""
        return self.layout or Layout.plain(self.feature_width)

    def plugin(self) -> Strategy:
        """The strategy this job's config names: the one the driver sent, unless the
        stage itself chose another (``auto``), then the registered one."""
        if self.strategy is not None and self.strategy.name == self.config.strategy:
            return self.strategy
        return registry.get(self.config.strategy)


@dataclass
class WorkerContext:
    """Rank, world and the two collective primitives a worker needs from its launcher."""

    rank: int
    world_size: int
    host: str
    all_gather: Callable[[str], list[str]]
    barrier: Callable[[], None]
    spec: JobSpec | None = None
    # the GPU addresses Spark assigned this task (TaskContext.resources()["gpu"]);
    # task/device.py pins the task to the first one
    gpus: tuple[str, ...] = ()

    @property
    def job(self) -> JobSpec:
        """The job this task trains for (benchmarks run tasks without one)."""
        if self.spec is None:
            raise RuntimeError("this task was launched without a JobSpec")
        return self.spec
