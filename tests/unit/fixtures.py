"""The helpers the unit tests share, in one place: test files import from here, never from
each other.

No Spark anywhere: a "world" is N threads (or processes) on loopback. Sections:

- ranks as threads, with Spark-like allGather/barrier (:func:`run_ranks`);
- meshes and connections: one :class:`~sparktrain.wire.mesh.Mesh` per rank thread
  (:func:`run_mesh_ranks`), a connected pair (:func:`pair`), a rank in its own process
  (:func:`process_rank`, which multiprocessing's spawn imports by name);
- the worker loop in threads: random partitions, a train run, the single-process
  reference it must equal;
- the parameter server in this process; tree_aggregate rounds over in-process blocks;
  pipelines in threads.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pickle
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import numpy as np
import torch

from sparktrain.config import TrainConfig
from sparktrain.data.partition_data import PartitionData
from sparktrain.models import mlp
from sparktrain.parallel.partition import partition
from sparktrain.parallel.pipeline import assemble as assemble_pipeline
from sparktrain.parallel.stage import PipelineSpec, train_stage
from sparktrain.result import TrainResult, assemble, load_state_records, state_to_bytes
from sparktrain.strategies.ps import protocol
from sparktrain.strategies.ps.client import ShardClient, connect_shards
from sparktrain.strategies.ps.server import ParameterServer, start_parameter_server
from sparktrain.strategies.tree_aggregate.task import Block, RoundSpec
from sparktrain.task.context import JobSpec, WorkerContext
from sparktrain.task.run_task import decode_value, run_partition
from sparktrain.wire import (
    CommStats,
    Connection,
    Mesh,
    accept,
    address_of,
    connect,
    make_allreduce,
    open_listener,
)

T = TypeVar("T")

SECRET = bytes(range(32))
JOB = "test-job"
HOST = "127.0.0.1"


# ---------------------------------------------------------------------- ranks as threads
class ThreadCollectives:
    """allGather and barrier for `world` threads, bounded by a timeout."""

    def __init__(self, world: int, timeout: float = 60.0) -> None:
        self._barrier = threading.Barrier(world, timeout=timeout)
        self._slots: list[Any] = [None] * world

    def all_gather(self, rank: int, message: str) -> list[str]:
        self._slots[rank] = message
        self._barrier.wait()
        out = list(self._slots)
        self._barrier.wait()
        return out

    def barrier(self) -> None:
        self._barrier.wait()


def run_ranks(
    world: int, fn: Callable[[int, ThreadCollectives], T], timeout: float = 120.0
) -> list[T]:
    """Call fn(rank, collectives) in `world` threads; re-raise the first failure."""
    coll = ThreadCollectives(world)
    results: list[Any] = [None] * world
    errors: list[BaseException | None] = [None] * world

    def body(rank: int) -> None:
        try:
            results[rank] = fn(rank, coll)
        except BaseException as exc:  # reported below
            errors[rank] = exc
            coll._barrier.abort()

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        if t.is_alive():
            raise TimeoutError(f"a rank did not finish within {timeout} s")
    real = [e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)]
    if real or any(errors):
        raise (real or [e for e in errors if e])[0]  # type: ignore[misc]
    return results


def worker_context(rank: int, world: int, coll: ThreadCollectives, spec: JobSpec) -> WorkerContext:
    """Rank ``rank``'s context, its allGather and barrier those of the threads."""
    return WorkerContext(
        rank, world, HOST, functools.partial(coll.all_gather, rank), coll.barrier, spec
    )


# ---------------------------------------------------------------------- meshes, connections
def open_listeners(world: int) -> tuple[list[Any], list[str]]:
    listeners = [open_listener(HOST) for _ in range(world)]
    return listeners, [address_of(lst) for lst in listeners]


def run_mesh_ranks(
    world: int,
    fn: Callable[[int, Mesh], Any],
    *,
    timeout: float = 5.0,
    join_timeout: float = 30.0,
    listeners: tuple[list[Any], list[str]] | None = None,
    ranks: list[int] | None = None,
    **mesh_kw: Any,
) -> list[Any]:
    """Run ``fn(rank, mesh)`` on one thread per rank; returns results or exceptions.

    ``ranks`` limits which ranks run (the others never show up); ``mesh_kw`` goes to every
    :class:`Mesh` (``max_frame_bytes``, ``link``...). Meshes are closed when ``fn`` returns
    or raises.
    """
    listeners_, addresses = listeners if listeners is not None else open_listeners(world)
    results: list[Any] = [None] * world

    def body(rank: int) -> None:
        try:
            mesh = Mesh(
                rank, world, listeners_[rank], addresses, SECRET, JOB, 0, timeout, **mesh_kw
            )
        except BaseException as exc:
            results[rank] = exc
            return
        try:
            results[rank] = fn(rank, mesh)
        except BaseException as exc:
            results[rank] = exc
        finally:
            mesh.close()

    in_threads(body, ranks if ranks is not None else range(world), join_timeout)
    return results


def in_threads(body: Callable[[int], None], ranks: Iterable[int], timeout: float) -> None:
    """``body(rank)`` on one daemon thread per rank; fails if one outlives ``timeout``."""
    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in ranks]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
        assert not t.is_alive(), "a rank thread hung"


def raise_first(results: list[Any]) -> None:
    for r in results:
        if isinstance(r, BaseException):
            raise r


def pair(
    timeout: float = 2.0,
    *,
    client_kw: dict[str, Any] | None = None,
    server_kw: dict[str, Any] | None = None,
) -> tuple[Connection | BaseException, Connection | BaseException]:
    """Connect a client (rank 0) to a server (rank 1); returns (client, server) or errors."""
    listener = open_listener(HOST)
    addr = address_of(listener)
    server: list[Connection | BaseException] = []

    def serve() -> None:
        kw: dict[str, Any] = dict(
            secret=SECRET, job_id=JOB, attempt=0, my_rank=1, timeout=timeout, stats=CommStats()
        )
        kw.update(server_kw or {})
        try:
            server.append(accept(listener, **kw))
        except BaseException as exc:
            server.append(exc)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    kw: dict[str, Any] = dict(
        secret=SECRET,
        job_id=JOB,
        attempt=0,
        my_rank=0,
        peer_rank=1,
        timeout=timeout,
        stats=CommStats(),
    )
    kw.update(client_kw or {})
    try:
        client: Connection | BaseException = connect(addr, **kw)
    except BaseException as exc:
        client = exc
    t.join(timeout + 5)
    listener.close()
    assert server, "the server side hung"
    return client, server[0]


def process_rank(rank: int, world: int, conn: Any) -> None:
    """Entry point of one rank in a separate process (multiprocessing spawn).

    Runs three ring then three tree allreduces of rank-seeded data on one mesh and
    sends back the last result of each.
    """
    try:
        listener = open_listener(HOST)
        conn.send(address_of(listener))
        addresses = conn.recv()
        rng = np.random.default_rng(100 + rank)
        buf = rng.standard_normal(10_007).astype(np.float32)
        outs = {}
        with Mesh(rank, world, listener, addresses, SECRET, JOB, 0, 10.0) as mesh:
            for algo, opts in (("ring", {"chunk_bytes": 4096}), ("tree", {})):
                reducer = make_allreduce(algo, mesh, **opts)
                for _ in range(3):
                    out = buf.copy()
                    reducer.allreduce_(out)
                outs[algo] = out.tobytes()
        conn.send(("ok", outs))
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


# ---------------------------------------------------------------------- the worker loop
def random_parts(
    sizes: list[int], seed: int = 0, width: int = 4, classes: int = 3
) -> list[PartitionData]:
    """One partition per size: standard-normal features, random labels, no validation."""
    rng = np.random.default_rng(seed)
    return [
        PartitionData(
            rng.standard_normal((n, width)).astype(np.float32),
            rng.integers(0, classes, n).astype(np.float64),
            np.zeros(n, bool),
        )
        for n in sizes
    ]


def loop_spec(**overrides: Any) -> JobSpec:
    """Full-batch SGD of a small MLP on 4 features, 3 classes (what :func:`sgd_reference`
    repeats in one process)."""
    cfg = TrainConfig(
        **{
            "epochs": 3,
            "batch_size": 1000,
            "lr": 0.5,
            "optimizer": "sgd",
            "shuffle": False,
            "progress": False,
            "comm_timeout": 10.0,
            "num_workers": 2,
            **overrides,
        }
    )
    return JobSpec(
        job_id="t",
        attempt=0,
        secret=b"k" * 32,
        config=cfg,
        model_fn=functools.partial(mlp, 4, (8,), 3),
        model_kwargs={},
        feature_width=4,
        num_outputs=3,
    )


def spec_with(spec: JobSpec, **changes: Any) -> JobSpec:
    return dataclasses.replace(spec, **changes)


# ---------------------------------------------------------------------- sparktrain.run
# ranks are threads here: torch's global RNG is shared, so seeding and building a model
# must not interleave (in Spark each task has its own Python worker)
SEEDED_BUILD = threading.Lock()


def seeded_mlp(seed: int) -> torch.nn.Module:
    with SEEDED_BUILD:
        torch.manual_seed(seed)
        return mlp(4, (8,), 3)


def run_in_threads(spec: Any, parts: list[Any], train_fn: Any) -> list[Any]:
    spec = dataclasses.replace(spec, train_fn=train_fn)
    world = len(parts)

    def rank_fn(rank: int, coll: ThreadCollectives) -> Any:
        return run_partition(worker_context(rank, world, coll, spec), parts[rank])

    return run_ranks(world, rank_fn, timeout=60.0)


def rank0_value(outputs: list[Any]) -> Any:
    records = [r for out in outputs for r in out]
    meta = json.loads(next(r.data for r in records if r.kind == "meta"))
    return decode_value(meta["value"], load_state_records(records, 0, meta)), meta


def train_in_threads(spec: JobSpec, parts: list[PartitionData], timeout: float = 120.0) -> Any:
    """``run_partition`` on one thread per partition; every rank's records."""
    world = len(parts)

    def rank_fn(rank: int, coll: ThreadCollectives) -> Any:
        return run_partition(worker_context(rank, world, coll, spec), parts[rank])

    return run_ranks(world, rank_fn, timeout=timeout)


def train_and_assemble(spec: JobSpec, parts: list[PartitionData]) -> TrainResult:
    """Train in threads, then assemble the ranks' records as the driver does."""
    records = [r for out in train_in_threads(spec, parts) for r in out]
    torch.manual_seed(0)
    return assemble(spec.model_fn(), records, spec.config, wall_s=1.0, stage_s=1.0)


def assert_close_params(got: torch.nn.Module, want: torch.nn.Module, tol: float) -> None:
    for g, w in zip(got.parameters(), want.parameters(), strict=True):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)


def sgd_reference(spec: JobSpec, parts: list[PartitionData]) -> torch.nn.Module:
    """Full-batch SGD in one process on the union of the partitions."""
    torch.manual_seed(spec.config.seed)
    model = spec.model_fn()
    opt = torch.optim.SGD(model.parameters(), lr=spec.config.lr)
    x = torch.from_numpy(np.concatenate([p.x for p in parts]))
    y = torch.from_numpy(np.concatenate([p.y for p in parts])).long()
    for _ in range(spec.config.epochs):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model


def state_bytes(outputs: Any) -> bytes:
    """The model state the ranks sent, in sequence order."""
    records = [r for out in outputs for r in out]
    return b"".join(
        r.data for r in sorted((r for r in records if r.kind == "state"), key=lambda r: r.seq)
    )


# ---------------------------------------------------------------------- parameter server
def ps_cfg(**overrides: Any) -> TrainConfig:
    base = {
        "epochs": 2,
        "batch_size": 4,
        "lr": 0.1,
        "optimizer": "sgd",
        "shuffle": True,
        "progress": False,
        "comm_timeout": 10.0,
        "num_workers": 2,
        "strategy": "ps",
    }
    return TrainConfig(**{**base, **overrides})


def ps_model() -> torch.nn.Module:
    return mlp(4, (8,), 3)


def seeded_ps_model(cfg: TrainConfig) -> torch.nn.Module:
    torch.manual_seed(cfg.seed)
    return ps_model()


def ps_spec(cfg: TrainConfig, ps_addresses: tuple[str, ...] = ()) -> JobSpec:
    return JobSpec(
        job_id="job",
        attempt=0,
        secret=SECRET,
        config=cfg,
        model_fn=functools.partial(mlp, 4, (8,), 3),
        model_kwargs={},
        feature_width=4,
        num_outputs=3,
        ps_addresses=ps_addresses,
    )


def ps_train(
    cfg: TrainConfig, parts: list[PartitionData]
) -> tuple[TrainResult, ParameterServer | None, list[Any]]:
    """Train in threads; for ps, with a server in this process. Returns (result, server,
    records)."""
    server = None
    addresses: tuple[str, ...] = ()
    if cfg.strategy == "ps":
        server = start_parameter_server(
            seeded_ps_model(cfg), cfg, host=HOST, secret=SECRET, job_id="job", attempt=0
        )
        addresses = tuple(server.addresses)
    spec = ps_spec(cfg, addresses)
    try:
        outputs = train_in_threads(spec, parts, timeout=60)
    finally:
        if server is not None:
            server.stop()
    records = [r for out in outputs for r in out]
    result = assemble(seeded_ps_model(cfg), records, cfg, wall_s=1.0, stage_s=1.0)
    if server is not None:
        server.finish(result)
    return result, server, records


def ps_server(cfg: TrainConfig, world: int = 1, attempt: int = 0) -> ParameterServer:
    return start_parameter_server(
        seeded_ps_model(cfg),
        cfg,
        host=HOST,
        secret=SECRET,
        job_id="job",
        attempt=attempt,
        world_size=world,
    )


def ps_clients(
    server: ParameterServer, rank: int = 0, spec: str = "none", **kw: Any
) -> list[ShardClient]:
    """Rank ``rank``'s clients of every shard, compressing with ``spec`` (``kw`` to
    :func:`connect_shards`, e.g. ``max_frame_bytes``)."""
    return connect_shards(
        server.addresses,
        rank=rank,
        secret=SECRET,
        job_id="job",
        attempt=0,
        timeout=5.0,
        stats=CommStats(),
        num_elements=server.ranges[-1][1],
        dtype=np.dtype(np.float32),
        compression=protocol.make_compression(spec),
        **kw,
    )


# ---------------------------------------------------------------------- tree_aggregate rounds
ROUNDS_WIDTH, ROUNDS_CLASSES = 6, 3


ROUNDS_MODEL_FN = functools.partial(mlp, ROUNDS_WIDTH, (5,), ROUNDS_CLASSES)


def rounds_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return ROUNDS_MODEL_FN()


def rounds_data(n: int, seed: int, val: bool = False) -> PartitionData:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, ROUNDS_WIDTH)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.float64) + (x[:, 1] > 0.5)
    return PartitionData(x, y, np.full(n, val))


def rounds_blocks(sizes: tuple[int, ...] = (37, 20)) -> list[Block]:
    return [
        Block(i, rounds_data(n, seed=i), rounds_data(10, seed=100 + i, val=True))
        for i, n in enumerate(sizes)
    ]


def rounds_spec(
    cfg: TrainConfig, model: torch.nn.Module, blocks: list[Block], job: str
) -> RoundSpec:
    rpe = max(1, -(-max(b.train.size for b in blocks) // (cfg.batch_size * cfg.local_steps)))
    return RoundSpec(
        job, cfg, state_to_bytes(model.state_dict()), rpe, evaluate_on_validation=True,
        model_fn=ROUNDS_MODEL_FN,
    )  # fmt: skip


def rounds_cfg(**kw: Any) -> TrainConfig:
    base: dict[str, Any] = dict(
        strategy="tree_aggregate", batch_size=8, lr=0.1, optimizer="sgd", progress=False
    )
    return TrainConfig(**{**base, **kw})


class _Handle:
    def __init__(self, value: Any) -> None:
        self.value = value
        self.destroyed = False

    def destroy(self, blocking: bool = False) -> None:
        self.destroyed = True


class FakeContext:
    """The SparkContext's ``broadcast``, in process; keeps every handle."""

    def __init__(self) -> None:
        self.handles: list[_Handle] = []

    def broadcast(self, value: Any) -> _Handle:
        self.handles.append(_Handle(value.copy()))
        return self.handles[-1]


class FakeBlocks:
    """treeAggregate over in-process blocks, through pickle like Spark's closures."""

    def __init__(self, blocks: list[Block]) -> None:
        self.blocks = blocks

    def getNumPartitions(self) -> int:
        return len(self.blocks)

    def treeAggregate(self, zero: Any, seq: Any, comb: Any, depth: int = 2) -> Any:
        from pyspark.cloudpickle import dumps

        seq, comb = pickle.loads(dumps((seq, comb)))  # closures must travel like Spark's
        return functools.reduce(comb, [seq(zero, b) for b in self.blocks])


class NoVolume:
    """A Spark volume meter that measures nothing."""

    def poll(self, final: bool = False) -> None:
        pass


# ---------------------------------------------------------------------- pipelines
PIPE_WIDTH, PIPE_CLASSES = 6, 3


def pipeline_model() -> torch.nn.Sequential:
    return mlp(PIPE_WIDTH, (16, 12, 8), PIPE_CLASSES)  # 7 layers: L R L R L R L


def pipeline_spec(
    stages: int,
    replicas: int,
    *,
    schedule: str = "1f1b",
    micro: int = 3,
    activation_dtype: str = "float32",
    **overrides: Any,
) -> PipelineSpec:
    cfg = TrainConfig(
        **{
            "epochs": 2,
            "batch_size": 10,
            "lr": 0.1,
            "optimizer": "sgd",
            "shuffle": True,
            "progress": False,
            "comm_timeout": 20.0,
            "num_workers": stages * replicas,
            "parallelism_pipeline": stages,
            "parallelism_data": replicas,
            **overrides,
        }
    )
    job = JobSpec(
        job_id="p",
        attempt=0,
        secret=b"s" * 32,
        config=cfg,
        model_fn=pipeline_model,
        model_kwargs={},
        feature_width=PIPE_WIDTH,
        num_outputs=PIPE_CLASSES,
        state_chunk_bytes=300,  # several chunks per stage
    )
    torch.manual_seed(cfg.seed)
    part = partition(pipeline_model(), stages, PIPE_WIDTH, balance="params")
    return PipelineSpec(job, part, replicas, micro, schedule, activation_dtype)


def pipeline_parts(sizes: list[int], seed: int = 1) -> list[PartitionData]:
    return random_parts(sizes, seed, width=PIPE_WIDTH, classes=PIPE_CLASSES)


def pipeline_records(spec: PipelineSpec, parts: list[PartitionData]) -> list[Any]:
    """Every stage task in a thread; all their records."""
    world = len(parts)

    def rank_fn(rank: int, coll: ThreadCollectives) -> Any:
        return train_stage(worker_context(rank, world, coll, spec.job), parts[rank], spec)

    return [r for rs in run_ranks(world, rank_fn) for r in rs]


def pipeline_run(spec: PipelineSpec, parts: list[PartitionData]) -> Any:
    """Every stage task in a thread; the reassembled result."""
    records = pipeline_records(spec, parts)
    torch.manual_seed(spec.job.config.seed)
    return assemble_pipeline(pipeline_model(), records, spec, wall_s=1.0, stage_s=1.0)


def pipeline_reference(spec: PipelineSpec, parts: list[PartitionData]) -> torch.nn.Module:
    """One process, one model: step t trains on the concatenation over replicas d of
    rows [t*B, (t+1)*B) of replica d's (shuffled) data, where replica d's data is the
    concatenation of the partitions of ranks d*P .. d*P + P - 1."""
    cfg = spec.job.config
    stages, replicas, batch = spec.stages, spec.replicas, cfg.batch_size
    torch.manual_seed(cfg.seed)
    model = pipeline_model()
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    rows = []
    for d in range(replicas):
        xs = np.concatenate([parts[d * stages + s].x for s in range(stages)])
        ys = np.concatenate([parts[d * stages + s].y for s in range(stages)])
        rows.append((torch.from_numpy(xs), torch.from_numpy(ys).long()))
    steps = max(-(-len(y) // batch) for _, y in rows)
    for epoch in range(cfg.epochs):
        orders = [
            np.random.default_rng([cfg.seed, d, epoch]).permutation(len(rows[d][1]))
            if cfg.shuffle
            else np.arange(len(rows[d][1]))
            for d in range(replicas)
        ]
        for t in range(steps):
            idx = [torch.from_numpy(o[t * batch : (t + 1) * batch]) for o in orders]
            x = torch.cat([rows[d][0][i] for d, i in enumerate(idx)])
            y = torch.cat([rows[d][1][i] for d, i in enumerate(idx)])
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    return model


def assert_same_state(got: torch.nn.Module, want: torch.nn.Module, atol: float = 1e-5) -> None:
    g, w = got.state_dict(), want.state_dict()
    assert g.keys() == w.keys()
    for k in w:
        torch.testing.assert_close(g[k], w[k], rtol=0, atol=atol, msg=k)
