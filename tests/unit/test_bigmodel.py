"""Big models: no transfer depends on the model (or a batch, or a mirror) fitting one
frame. Every chunked path runs here under a tiny frame cap (4 KiB or less), so each
transfer takes many frames; the same code moves a 1 GiB+ model under the real cap
(tests/integration/test_bigmodel.py)."""

from __future__ import annotations

import dataclasses
import functools
import json
import secrets
import threading

import numpy as np
import pytest
import torch
from torch import nn

from sparktrain.driver.services.state_receiver import StateReceiver
from sparktrain.errors import FrameError, WorkerError
from sparktrain.models import embedding_regressor, mlp
from sparktrain.result import assemble as _assemble
from sparktrain.task.memory import peak_rss_bytes, reset_peak_rss
from sparktrain.task.state_sender import send_state, start_from_rank0, tensor_layout
from sparktrain.wire import Mesh, make_allreduce
from sparktrain.wire.chunked import (
    PiecewiseAllreduce,
    broadcast_,
    pieces,
    recv_chunked_into,
    send_chunked,
    tree_children,
    tree_parent,
)

from .fixtures import (
    assert_close_params,
    assert_same_state,
    loop_spec,
    pair,
    pipeline_parts,
    pipeline_reference,
    pipeline_run,
    pipeline_spec,
    raise_first,
    random_parts,
    run_mesh_ranks,
    sgd_reference,
    train_and_assemble,
    train_in_threads,
)

pytestmark = pytest.mark.timeout(120)

CAP = 4096  # bytes per frame in these tests


def _run_capped(world: int, fn) -> list:
    """``fn(rank, mesh)`` on one thread per rank, every mesh with frame cap ``CAP``."""
    results = run_mesh_ranks(world, fn, timeout=10.0, join_timeout=60.0, max_frame_bytes=CAP)
    raise_first(results)
    return results


def test_pieces_cover_the_array_and_respect_the_cap():
    arr = np.arange(1001, dtype=np.float32).reshape(7, 143)
    got = list(pieces(arr, 400))
    assert all(p.nbytes <= 400 for p in got) and len(got) == 11
    np.testing.assert_array_equal(np.concatenate(got), arr.reshape(-1))
    assert all(np.shares_memory(p, arr) for p in got)  # views, no copy
    assert list(pieces(np.zeros(0, np.float64), 8)) == []
    assert [p.size for p in pieces(np.zeros(3, np.float64), 1)] == [1, 1, 1]  # >= 1 element


def test_binomial_tree_reaches_every_rank_once():
    for n in range(1, 12):
        kids = {r: tree_children(r, n) for r in range(n)}
        assert sorted(c for cs in kids.values() for c in cs) == list(range(1, n))
        assert all(tree_parent(c) == r for r, cs in kids.items() for c in cs)


def test_send_chunked_moves_an_array_over_the_cap_into_place():
    a, b = pair()  # default cap: the pieces are what the caller asked for
    assert not isinstance(a, BaseException) and not isinstance(b, BaseException)
    try:
        src = np.random.default_rng(0).standard_normal((50, 70))
        out = np.empty_like(src)
        frames = send_chunked(a, src, 1000)
        recv_chunked_into(b, out, 1000)
        assert frames == -(-src.nbytes // 1000) and frames > 1
        np.testing.assert_array_equal(out, src)
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("world", [2, 3, 5])
def test_broadcast_copies_rank0_bitwise_in_pieces(world):
    def arrays(rank: int) -> list[np.ndarray]:
        rng = np.random.default_rng(rank)
        special = np.array([-0.0, np.inf, -np.inf, 1e-45], np.float32)
        nan = np.array([0x7FC00001 + rank], np.uint32).view(np.float32)  # NaN payloads
        return [
            np.concatenate([rng.standard_normal(5000).astype(np.float32), special, nan]),
            rng.integers(-(2**60), 2**60, 700),  # int64: what a float sum cannot carry
            np.zeros(0, np.float64),
            rng.integers(0, 255, 3, dtype=np.uint8),
        ]

    want = [a.tobytes() for a in arrays(0)]

    def body(rank: int, mesh: Mesh) -> tuple[list[bytes], int, int]:
        mine = arrays(rank)
        got = broadcast_(mesh, mine, chunk_bytes=1 << 20)  # capped to the mesh's 4 KiB
        return [a.tobytes() for a in mine], got, mesh.stats.frames_recv

    for rank, (got, received, frames) in enumerate(_run_capped(world, body)):
        assert got == want, f"rank {rank}"
        assert received == (0 if rank == 0 else sum(len(w) for w in want))
        if rank:
            assert frames >= sum(-(-len(w) // CAP) for w in want)  # every piece <= cap


class _Mixed(nn.Module):
    """Parameters and buffers of every kind a state can hold."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(rank)
        self.weight = nn.Parameter(torch.randn(3000, generator=g))  # 12 KB: 3 frames
        self.weight.data[0] = -0.0 if rank == 0 else 0.0
        self.register_buffer("bf16", torch.randn(17, generator=g).to(torch.bfloat16))
        self.register_buffer("steps", torch.tensor(rank * 1000 + 7))
        self.register_buffer("mask", torch.rand(9, generator=g) > 0.5)
        self.t = nn.Parameter(torch.randn(40, 30, generator=g).t())  # not contiguous


def _raw(model: nn.Module) -> list[bytes]:
    return [t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            for t in [*model.parameters(), *model.buffers()]]  # fmt: skip


def test_replicas_start_from_rank0_bitwise_in_every_dtype_under_a_tiny_cap():
    """Before: a float64 tree allreduce of the whole flat model against zeros, in one
    frame (a 4 KiB cap: FrameError; the real cap: 134M parameters); -0.0 came back as
    +0.0 and integer buffers stayed as they were."""
    want = _raw(_Mixed(0))

    def body(rank: int, mesh: Mesh) -> list[bytes]:
        model = _Mixed(rank)
        ptrs = [p.data_ptr() for p in model.parameters()]
        start_from_rank0(model, mesh, 1 << 20)
        assert [p.data_ptr() for p in model.parameters()] == ptrs  # in place, no copy
        return _raw(model)

    for got in _run_capped(3, body):
        assert got == want


def test_the_old_whole_model_frame_is_refused_under_the_cap():
    """What failed every big fit: one frame of the whole flat model over the cap."""

    def body(rank: int, mesh: Mesh) -> None:
        make_allreduce("tree", mesh).allreduce_(np.zeros(CAP // 8 + 1, np.float64))

    with pytest.raises(FrameError, match="cap"):
        _run_capped(2, body)


def test_piecewise_tree_equals_one_tree_call_bitwise():
    bufs = [np.random.default_rng(r).standard_normal(3001).astype(np.float32) for r in range(3)]
    whole = (bufs[0] + bufs[2]) + bufs[1]  # the tree's order for 3 ranks (rank 2 folds in)

    def body(rank: int, mesh: Mesh) -> np.ndarray:
        buf = bufs[rank].copy()
        PiecewiseAllreduce(make_allreduce("tree", mesh), CAP).allreduce_(buf)
        return buf

    for got in _run_capped(3, body):
        np.testing.assert_array_equal(got, whole)


@pytest.mark.parametrize("strategy", ["ring", "tree"])
def test_training_under_a_frame_cap_smaller_than_the_model(strategy):
    """The model (2,051 float32 parameters: 8 KB, 16 KB as float64) is larger than a
    frame: the start, every gradient bucket and the state return go in pieces."""
    spec = loop_spec(strategy=strategy, bucket_mb=1.0)
    spec = dataclasses.replace(
        spec, model_fn=functools.partial(mlp, 4, (256,), 3), max_frame_bytes=CAP
    )
    parts = random_parts([7, 9])
    result = train_and_assemble(spec, parts)
    assert_close_params(result.model, sgd_reference(spec, parts), 1e-5)
    assert result.summary["replicas_in_sync"]
    peaks = result.summary["peak_rss_bytes_per_worker"]
    assert len(peaks) == 2 and all(p > 0 for p in peaks)


def test_rank0_streams_its_state_into_the_drivers_model_in_pieces():
    """The trained state goes to the driver's receiver over the wire (no task result,
    no maxResultSize), 300-byte frames, straight into the driver's own tensors."""
    spec = dataclasses.replace(loop_spec(strategy="ring"), state_chunk_bytes=300)
    parts = random_parts([7, 9])
    torch.manual_seed(123)
    driver_model = spec.model_fn()  # other weights than the trained ones
    ptrs = [t.data_ptr() for t in driver_model.state_dict().values()]
    receiver = StateReceiver(
        "127.0.0.1", driver_model, secret=spec.secret, job_id=spec.job_id, attempt=0
    )
    try:
        spec = dataclasses.replace(spec, state_address=receiver.address)
        records = [r for out in train_in_threads(spec, parts) for r in out]
        assert receiver.done.is_set()
        assert receiver.received_bytes == sum(p.numel() * 4 for p in driver_model.parameters())
    finally:
        receiver.stop()
    assert not [r for r in records if r.kind == "state"]  # nothing big as a task result
    result = _assemble(driver_model, records, spec.config, wall_s=1.0, stage_s=1.0)
    assert result.model is driver_model
    assert [t.data_ptr() for t in driver_model.state_dict().values()] == ptrs
    for got, want in zip(
        driver_model.parameters(), sgd_reference(spec, parts).parameters(), strict=True
    ):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert result.summary["history"] and result.summary["replicas_in_sync"]


def test_state_of_every_dtype_arrives_bitwise_and_a_wrong_model_is_refused():
    secret = secrets.token_bytes(32)
    sent = _Mixed(0)
    driver = _Mixed(1)
    receiver = StateReceiver("127.0.0.1", driver, secret=secret, job_id="j", attempt=2)
    kw = {"secret": secret, "job_id": "j", "attempt": 2, "timeout": 5.0}
    try:
        assert send_state(receiver.address, sent.state_dict(), chunk_bytes=1000, **kw) > 12000
        assert receiver.done.is_set()
        for name, t in driver.state_dict().items():
            want = sent.state_dict()[name]
            assert t.dtype == want.dtype and torch.equal(
                t.contiguous().view(-1).view(torch.uint8),
                want.contiguous().view(-1).view(torch.uint8),
            ), name
        # a second state for the same attempt is refused
        with pytest.raises(WorkerError, match="already received"):
            send_state(receiver.address, sent.state_dict(), chunk_bytes=1000, **kw)
    finally:
        receiver.stop()
    before = [t.clone() for t in driver.state_dict().values()]
    receiver = StateReceiver("127.0.0.1", driver, secret=secret, job_id="j", attempt=2)
    try:
        with pytest.raises(WorkerError, match="model_fn must build the same model"):
            send_state(receiver.address, mlp(4, (8,), 3).state_dict(), chunk_bytes=1000, **kw)
        assert not receiver.done.is_set()
    finally:
        receiver.stop()
    for t, b in zip(driver.state_dict().values(), before, strict=True):
        assert torch.equal(t, b)  # refused before a byte was written


def test_only_rank0_may_return_the_state():
    from sparktrain.wire.frames import KIND_CONTROL
    from sparktrain.wire.handshake import DRIVER_RANK, connect
    from sparktrain.wire.stats import CommStats

    secret = secrets.token_bytes(32)
    driver = _Mixed(1)
    receiver = StateReceiver("127.0.0.1", driver, secret=secret, job_id="j", attempt=0)
    try:
        with connect(
            receiver.address, secret=secret, job_id="j", attempt=0, my_rank=1,
            peer_rank=DRIVER_RANK, timeout=5.0, stats=CommStats(),
        ) as conn:  # fmt: skip
            head = {"layout": tensor_layout(_Mixed(0).state_dict()), "chunk_bytes": 1000}
            conn.send_bytes(json.dumps(head).encode(), KIND_CONTROL)
            _, raw = conn.recv_bytes(KIND_CONTROL)
        assert "only rank 0" in json.loads(raw)["error"]
        assert not receiver.done.is_set()
    finally:
        receiver.stop()


def _send_part(address, model, keys, rank, secret):
    """``rank`` streams the named ``keys`` of ``model`` (its part of the state)."""
    part = {k: v for k, v in model.state_dict().items() if k in keys}
    kw = {"secret": secret, "job_id": "j", "attempt": 0, "timeout": 5.0}
    return send_state(address, part, rank=rank, chunk_bytes=1000, **kw)


def test_several_senders_each_stream_their_own_keys_at_once():
    """Pipeline stages: ranks 0 and 3 each send their part; ``done`` once both are in."""
    secret = secrets.token_bytes(32)
    sent, driver = _Mixed(0), _Mixed(1)
    senders = {0: ["weight", "mask"], 3: ["bf16", "steps", "t"]}
    receiver = StateReceiver(
        "127.0.0.1", driver, secret=secret, job_id="j", attempt=0, senders=senders
    )
    try:
        _send_part(receiver.address, sent, senders[3], 3, secret)
        assert not receiver.done.is_set() and receiver.pending == [0]
        with pytest.raises(WorkerError, match="from rank 3 was already received"):
            _send_part(receiver.address, sent, senders[3], 3, secret)
        got = []
        thread = threading.Thread(
            target=lambda: got.append(_send_part(receiver.address, sent, senders[0], 0, secret))
        )
        thread.start()
        thread.join(10)
        assert receiver.done.is_set() and receiver.pending == []
        assert receiver.received_bytes == got[0] + sum(
            sent.state_dict()[k].numel() * sent.state_dict()[k].element_size() for k in senders[3]
        )
    finally:
        receiver.stop()
    assert _raw(driver) == _raw(sent)


def test_a_wrong_rank_or_part_is_refused_before_a_byte_is_written():
    secret = secrets.token_bytes(32)
    sent, driver = _Mixed(0), _Mixed(1)
    before = _raw(driver)
    senders = {0: ["weight", "mask"], 1: ["bf16", "steps", "t"]}
    receiver = StateReceiver(
        "127.0.0.1", driver, secret=secret, job_id="j", attempt=0, senders=senders
    )
    try:
        with pytest.raises(WorkerError, match="only rank 0, 1 return it"):
            _send_part(receiver.address, sent, senders[1], 2, secret)  # rank 2 sends none
        with pytest.raises(WorkerError, match="model_fn must build the same model"):
            _send_part(receiver.address, sent, ["weight"], 0, secret)  # "mask" missing
        with pytest.raises(WorkerError, match="model_fn must build the same model"):
            _send_part(receiver.address, sent, senders[1], 0, secret)  # rank 1's keys
        assert not receiver.done.is_set() and receiver.pending == [0, 1]
    finally:
        receiver.stop()
    assert _raw(driver) == before


@pytest.mark.parametrize(
    ("senders", "match"),
    [
        ({0: ["weight", "nope"], 1: ["bf16", "steps", "t", "mask"]}, "no tensor 'nope'"),
        ({0: ["weight", "mask"], 1: ["mask", "bf16", "steps", "t"]}, "two state senders"),
        ({0: ["weight", "mask"], 1: ["bf16", "steps"]}, "no state sender"),
    ],
)
def test_senders_must_split_the_model_exactly(senders, match):
    from sparktrain.errors import ConfigError

    with pytest.raises(ConfigError, match=match):
        StateReceiver("127.0.0.1", _Mixed(1), secret=b"s" * 32, job_id="j", attempt=0,
                      senders=senders)  # fmt: skip


def test_the_weights_mirror_is_fetched_in_pieces():
    from sparktrain.compress.registry import build
    from sparktrain.strategies.tree_aggregate.driver_weights import DownloadEncoder, WeightsServer
    from sparktrain.strategies.tree_aggregate.task_weights import fetch_mirror

    comp = build("int8")
    assert comp is not None
    secret = secrets.token_bytes(32)
    server = WeightsServer(
        "127.0.0.1", DownloadEncoder(comp, 0), secret=secret, job_id="j", chunk_bytes=CAP
    )
    try:
        w = np.random.default_rng(0).standard_normal(10_000).astype(np.float32)  # 40 KB
        server.next(w)
        server.next(w + 1)
        kw = {"secret": secret, "job_id": "j", "seq": 1, "numel": w.size, "timeout": 5.0}
        got = [fetch_mirror(server.address, partition=p, **kw) for p in range(3)]
        for g in got:
            np.testing.assert_array_equal(g, server._encoder.mirror)
        assert server.snapshots == 1  # one copy of the mirror for the round, not one a task
    finally:
        server.stop()


def test_pipeline_activations_and_rows_travel_in_pieces():
    spec = pipeline_spec(2, 2, micro=2)
    spec = dataclasses.replace(spec, job=dataclasses.replace(spec.job, max_frame_bytes=64))
    parts = pipeline_parts([17, 9, 5, 6])  # 17 rows x 6 features = 408 bytes: 7 frames
    result = pipeline_run(spec, parts)
    assert_same_state(result.model, pipeline_reference(spec, parts))
    assert result.summary["replicas_in_sync"]


def test_embedding_regressor_and_peak_rss():
    model = embedding_regressor(1000, 8)
    assert sum(p.numel() for p in model.parameters()) == 1000 * 8 + 8 + 1
    out = model(torch.tensor([[3.0], [999.0]]))
    assert out.shape == (2, 1)
    out = model(torch.tensor([[3.0, 4.0]]))  # several ids a row: their mean
    assert out.shape == (1, 1)
    # ids arrive as int64 columns now, so a table past 2**24 rows is allowed; none is not
    with pytest.raises(ValueError, match="num_embeddings must be >= 1"):
        embedding_regressor(0, 1)
    assert peak_rss_bytes() > 10 << 20
    big = np.ones(64 << 17)  # 64 MiB, touched
    high = peak_rss_bytes()
    del big
    if reset_peak_rss():  # Linux: the peak restarts from the current size
        assert peak_rss_bytes() < high - (32 << 20)


def test_gradients_live_in_the_buckets_no_second_copy():
    """Before: the buckets were a full copy of the gradients (a model's worth of memory)
    and every step copied the gradients in and the averages back out."""
    from sparktrain.task.buckets import GradientBuckets

    class _Sum:  # one rank: the sum is the buffer itself
        def allreduce_(self, buf: np.ndarray) -> None:
            pass

    torch.manual_seed(0)
    model = mlp(4, (32, 16), 3)
    ref = mlp(4, (32, 16), 3)
    ref.load_state_dict(model.state_dict())
    x, y = torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1])
    buckets = GradientBuckets(list(model.parameters()), 600)  # several buckets
    buckets.bind_grads()
    flats = [b.flat for b in buckets.buckets]
    for _ in range(2):  # accumulate into the views across steps (zeroed in place)
        for p in model.parameters():
            assert p.grad is not None
            p.grad.zero_()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        assert buckets.average_(_Sum(), 5) == 5
    ref.zero_grad()
    torch.nn.functional.cross_entropy(ref(x), y).backward()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        assert any(np.shares_memory(p.grad.numpy(), f) for f in flats)
        torch.testing.assert_close(p.grad, q.grad)
