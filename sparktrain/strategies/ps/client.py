"""The worker's side of the parameter server: ``StepSync`` for ``strategy="ps"``.

Each step, :class:`ParameterServerSync` flattens the gradients, and for every shard at
once (one thread per shard connection) pushes its slice and pulls the shard's delta
back into the flat parameter vector, then copies that into the model. The first pull,
in the constructor, fetches the server's values, so every rank starts from the
server's parameters whatever its own initialisation.

Connections count their bytes into the mesh's :class:`~sparktrain.wire.stats.CommStats`,
so the run summary's byte totals include the PS traffic.

With ``config.compression`` (see :mod:`sparktrain.strategies.ps.protocol`) each shard client keeps
its own push codec (compressor state, error-feedback residual included, for its slice;
PowerSGD sees the parameter shapes that fall in the slice) and, for ``delta+`` specs, a
pull codec that adds the shard's compressed deltas to the worker's copy. A compressed
push adds the uncompressed slice's bytes to ``raw_bytes_sent`` itself, so the summary's
ratio compares against what the plain push would have sent.

Overlap (``config.overlap``): the unit of a push is a shard (one push per shard per
step; the protocol has no partial pushes), so a shard's exchange (push, then pull into
the flat copy, not the model) starts from a gradient hook as soon as every parameter
that overlaps its range has its gradient, while backward continues on the earlier
layers. Shards are contiguous ranges of the flat vector in ``model.parameters()``
order and backward runs last layer first, so the last shard goes first. With one
shard (``ps_shards=1``) its gradient is complete only when backward is, so there is
nothing to overlap; use ``ps_shards >= 2`` to overlap. The model's parameters are
written only after every exchange is done, in :meth:`ParameterServerSync.step`.

Payloads travel in chunks (:func:`~sparktrain.strategies.ps.protocol.send_chunked`): a push in
chunks of the size the shard named in its last reply, a pull in the chunks the shard
chose, so no transfer depends on the model fitting one frame.

Reconnection: a request whose connection breaks (reset, end of stream; not a timeout,
not a connection this side closed) dials the shard again and is sent again, at most
``MAX_RECONNECTS`` times per request. A resent push carries the same step number, so a
shard that applied it before the break acknowledges it as a duplicate; the first pull
on the new connection fetches the values.

Per-layer compression (a table in ``config.compression``) is refused here: shards cut
the flat vector at element granularity with one codec per shard, so a layer's spec
could not be honoured inside a shard. Ring and tree accept a table.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import functools
import itertools
import logging
import math
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from sparktrain.errors import CommError, ConfigError, FrameError, PeerLostError
from sparktrain.sparse.rows import rows_of
from sparktrain.strategies.ps import protocol
from sparktrain.strategies.ps.layout import (
    NUMPY_DTYPES,
    dense_params,
    dense_ranges,
    flat_dtype,
    flatten,
    row_ranges,
    served_tables,
    shard_ranges,
    unflatten,
)
from sparktrain.task.buckets import GradientReadiness
from sparktrain.task.context import WorkerContext
from sparktrain.wire.connection import Connection
from sparktrain.wire.frames import KIND_DATA, MAX_FRAME_BYTES_DEFAULT
from sparktrain.wire.handshake import DRIVER_RANK, connect
from sparktrain.wire.link import LinkProfile, link_from_config
from sparktrain.wire.mesh import Mesh
from sparktrain.wire.security import WireSecurity
from sparktrain.wire.stats import CommStats

TableRows = Sequence[tuple[np.ndarray, np.ndarray]]
"""One push's sparse rows for one shard: per table, shard-local int64 ids (ascending,
each once) and their ``[n, dim]`` gradient rows."""

log = logging.getLogger(__name__)

REPLY_GRACE_S = 5.0
"""Extra read time beyond ``comm_timeout``: a shard waits at most ``comm_timeout`` for a
laggard and then answers with the laggard's name, which must arrive before this side's
own timeout blames the server."""
BYE_TIMEOUT_S = 1.0
MAX_RECONNECTS = 2
"""Dials per request after a broken connection (each bounded by ``comm_timeout``)."""


class ShardClient:
    """One worker's connection to one shard: push, pull and goodbye messages.

    ``version`` is the shard version the worker's copy of ``[lo, hi)`` corresponds to
    (-1 before the first pull). Not thread-safe: one request at a time per shard.
    With ``dial`` (a function returning a fresh authenticated connection to the same
    shard) a request whose connection breaks reconnects and is sent again.
    """

    def __init__(
        self,
        conn: Connection,
        *,
        index: int,
        lo: int,
        hi: int,
        dtype: np.dtype[Any],
        job_id: str,
        attempt: int,
        rank: int,
        codec: protocol.Codec | None = None,
        pull_codec: protocol.CompressorCodec | None = None,
        dial: Callable[[], Connection] | None = None,
    ) -> None:
        self.conn = conn
        self.dial = dial
        self.reconnects = 0
        self._closed = False
        # until the shard names its chunk size (in every reply): what our frame cap allows
        self.chunk_bytes = protocol.chunk_size(conn.max_frame_bytes, None, 8)
        self.codec: protocol.Codec = codec if codec is not None else protocol.IdentityCodec()
        self.pull_codec = pull_codec
        self.index = index
        self.lo, self.hi = lo, hi
        self.job_tag = protocol.job_tag(job_id)
        self.attempt = attempt
        self.rank = rank
        self.version = -1
        # one chunk, not a shard: deltas are added chunk by chunk (a 150M-parameter model
        # would otherwise pay a fifth copy of itself in every worker)
        self._scratch = np.empty(0, dtype=dtype)
        self.unchanged_pulls = 0
        self.payload_pulls = 0
        self.rows_pulled = 0

    def _fail(self, status: int, lost: int, what: str) -> CommError:
        """Read the reason that follows an error status and build the error to raise."""
        try:
            _, text = self.conn.recv_bytes(protocol.KIND_TEXT, max_bytes=protocol.MAX_TEXT_BYTES)
            reason = text.decode("utf-8", "replace")
        except CommError:
            reason = protocol.STATUS_NAMES.get(status, f"status {status}")
        if status == protocol.LOST and lost >= 0:
            return PeerLostError(lost, f"the parameter server reports: {reason}")
        return CommError(
            f"parameter-server shard {self.index} refused the {what} of rank {self.rank} "
            f"({protocol.STATUS_NAMES.get(status, status)}): {reason}"
        )

    def push(
        self,
        step: int,
        count: int,
        grad: np.ndarray | None,
        *,
        attempt: int | None = None,
        lr: float = math.nan,
        rows: TableRows = (),
    ) -> int:
        """Push the gradient of ``step`` (``count`` samples; ``grad`` None when 0).

        Returns ``OK`` or ``DUPLICATE`` (acknowledged, not applied again); raises for
        every other status. ``attempt`` overrides the stage attempt (tests only); ``lr``
        (unless NaN) is the rate the worker's schedule gives this step; ``rows`` are
        the step's rows of every sparse table this shard holds (one entry per table,
        sent after the gradient when there is one).
        """
        has = count > 0 and grad is not None
        payload: np.ndarray | None = None
        if has:
            assert grad is not None
            # encoded once: a resent push carries the same bytes (the codec's state moved)
            payload = self.codec.encode(grad) if self.codec.compressed else grad
        for tries in itertools.count():
            try:
                status, lost = self._push_once(step, count, grad, payload, attempt, lr, rows)
                break
            except (CommError, OSError) as exc:
                self._reconnect_or_raise(exc, tries, f"push of step {step}")
        if status not in (protocol.OK, protocol.DUPLICATE):
            raise self._fail(status, lost, f"push of step {step}")
        return int(status)

    def _push_once(
        self,
        step: int,
        count: int,
        grad: np.ndarray | None,
        payload: np.ndarray | None,
        attempt: int | None,
        lr: float = math.nan,
        rows: TableRows = (),
    ) -> tuple[int, int]:
        chunk = self.chunk_bytes
        header = protocol.PUSH.pack(
            self.job_tag,
            self.attempt if attempt is None else attempt,
            self.rank,
            step,
            count if payload is not None else 0,
            self.version,
            1 if payload is not None else 0,
            0 if payload is None else payload.nbytes,
            chunk,
            lr,
        )
        self.conn.send_bytes(header, protocol.KIND_PUSH)
        if payload is not None:
            assert grad is not None
            if self.codec.compressed:
                protocol.send_chunked(self.conn, payload, protocol.KIND_CPAYLOAD, chunk)
                self.conn.stats.add_sent(0, grad.nbytes)  # what the plain push sends
            else:
                protocol.send_chunked(self.conn, payload, KIND_DATA, chunk)
            for t, (ids, values) in enumerate(rows):
                self.conn.send_bytes(protocol.ROWS.pack(t, len(ids)), protocol.KIND_ROWS)
                if len(ids):
                    protocol.send_rows(self.conn, ids, values, chunk)
        _, reply = self.conn.recv_bytes(protocol.KIND_ACK, max_bytes=protocol.MAX_HEADER_BYTES)
        status, lost, _version = protocol.ACK.unpack(reply)
        return int(status), int(lost)

    def _reconnect_or_raise(self, exc: BaseException, tries: int, what: str) -> None:
        """After a broken connection: dial the shard again, or re-raise ``exc`` when this
        side closed it, the peer timed out (a silent server is not a reset), there is no
        ``dial`` or the request used its reconnections."""
        timed_out = isinstance(exc, TimeoutError) or isinstance(exc.__cause__, TimeoutError)
        if (
            self._closed
            or self.dial is None
            or tries >= MAX_RECONNECTS
            or timed_out
            or not isinstance(exc, (PeerLostError, OSError))
        ):
            raise exc
        log.warning(
            "rank %d: connection to parameter-server shard %d broke during the %s (%s); "
            "reconnecting",
            self.rank,
            self.index,
            what,
            exc,
        )
        self.conn.close()
        try:
            conn = self.dial()
        except (CommError, OSError) as again:
            raise exc from again
        if self._closed:  # closed by another thread meanwhile
            conn.close()
            raise exc
        self.conn = conn
        self.version = -1  # our copy may hold half a delta: fetch the values
        self.reconnects += 1

    def pull(self, step: int, out: np.ndarray) -> int:
        """Bring ``out`` (this shard's slice of the flat parameters) up to date.

        ``step`` is the step just pushed (-1 for the first pull); the shard answers
        when the mode allows (sync: step applied; ssp: within the staleness bound).
        Returns the encoding received (``UNCHANGED``, ``DELTA`` or ``FULL``).
        """
        for tries in itertools.count():
            try:
                return self._pull_once(step, out)
            except _Refused as refused:
                raise self._fail(refused.status, refused.lost, f"pull after step {step}") from None
            except (CommError, OSError) as exc:
                self._reconnect_or_raise(exc, tries, f"pull after step {step}")
        raise AssertionError("unreachable")

    def _pull_once(self, step: int, out: np.ndarray) -> int:
        self.conn.send_bytes(
            protocol.PULL.pack(self.attempt, self.rank, step, self.version), protocol.KIND_PULL
        )
        _, reply = self.conn.recv_bytes(protocol.KIND_REPLY, max_bytes=protocol.MAX_HEADER_BYTES)
        status, lost, version, encoding, elements, nbytes, chunk = protocol.REPLY.unpack(reply)
        if status != protocol.OK:
            raise _Refused(status, lost)
        self.chunk_bytes = protocol.chunk_size(self.conn.max_frame_bytes, chunk, 8)
        if elements != self.hi - self.lo:
            raise ConfigError(
                f"parameter-server shard {self.index} holds {elements} elements, this worker "
                f"expects {self.hi - self.lo}: the workers' model differs from the driver's"
            )
        if encoding in (protocol.DELTA, protocol.FULL) and nbytes != out.nbytes:
            raise FrameError(f"a pull of {nbytes} bytes into a {out.nbytes}-byte shard")
        if encoding == protocol.DELTA:
            # the same float ops as the server's mirror, chunk by chunk
            self._scratch = protocol.recv_chunked_add(
                self.conn, out, KIND_DATA, chunk, self._scratch
            )
            self.payload_pulls += 1
        elif encoding == protocol.CDELTA:
            if self.pull_codec is None:
                raise CommError(
                    f"parameter-server shard {self.index} sent a compressed delta to a worker "
                    "that expects exact ones: the driver and the workers disagree on compression"
                )
            if not 0 < nbytes <= protocol.max_message_bytes(self.hi - self.lo):
                raise FrameError(f"a compressed pull of {nbytes} bytes for {out.size} values")
            blob = np.empty(nbytes, np.uint8)
            protocol.recv_chunked(self.conn, blob, protocol.KIND_CPAYLOAD, chunk)
            # the same op on the same decoded bytes as the shard's mirror: bit-identical
            self.pull_codec.add_into(blob, out)
            self.payload_pulls += 1
        elif encoding == protocol.FULL:
            protocol.recv_chunked(self.conn, out, KIND_DATA, chunk)
            self.payload_pulls += 1
        elif encoding == protocol.UNCHANGED:
            self.unchanged_pulls += 1
        else:
            raise CommError(f"parameter-server shard {self.index} sent unknown encoding {encoding}")
        self.version = int(version)
        return int(encoding)

    def pull_rows(self, table: int, ids: np.ndarray, out: np.ndarray) -> None:
        """Fetch the current rows ``ids`` (shard-local int64) of sparse table ``table``
        into ``out`` (``[len(ids), dim]``, contiguous); reconnects as :meth:`pull`."""
        for tries in itertools.count():
            try:
                self._pull_rows_once(table, ids, out)
                return
            except _Refused as refused:
                raise self._fail(refused.status, refused.lost, "row pull") from None
            except (CommError, OSError) as exc:
                self._reconnect_or_raise(exc, tries, "row pull")

    def _pull_rows_once(self, table: int, ids: np.ndarray, out: np.ndarray) -> None:
        header = protocol.RPULL.pack(self.attempt, self.rank, table, len(ids))
        self.conn.send_bytes(header, protocol.KIND_RPULL)
        protocol.send_rows(self.conn, ids, None, self.chunk_bytes)
        _, reply = self.conn.recv_bytes(protocol.KIND_RREPLY, max_bytes=protocol.MAX_HEADER_BYTES)
        status, lost, n, chunk = protocol.RREPLY.unpack(reply)
        if status != protocol.OK:
            raise _Refused(status, lost)
        if n != len(ids):
            raise FrameError(f"a row pull of {len(ids)} rows was answered with {n}")
        if n:
            protocol.recv_chunked(self.conn, out.reshape(-1), KIND_DATA, chunk)
        self.rows_pulled += n

    def bye(self, clean: bool) -> None:
        """Tell the shard this rank is done (``clean``) or failed; best effort."""
        with contextlib.suppress(CommError, OSError):
            self.conn.set_timeout(BYE_TIMEOUT_S)
            self.conn.send_bytes(
                protocol.BYE.pack(self.attempt, self.rank, int(clean)), protocol.KIND_BYE
            )

    def close(self) -> None:
        self._closed = True
        self.conn.close()


class _Refused(Exception):
    """A pull answered with an error status (raised as the shard's reason, never retried)."""

    def __init__(self, status: int, lost: int) -> None:
        super().__init__(status, lost)
        self.status, self.lost = status, lost


def connect_shards(
    addresses: tuple[str, ...] | list[str],
    *,
    rank: int,
    secret: bytes,
    job_id: str,
    attempt: int,
    timeout: float,
    stats: CommStats,
    num_elements: int,
    dtype: np.dtype[Any],
    compression: protocol.Compression | None = None,
    param_shapes: Sequence[tuple[int, ...]] = (),
    seed: int = 0,
    link: LinkProfile | None = None,
    security: WireSecurity | None = None,
    max_frame_bytes: int = MAX_FRAME_BYTES_DEFAULT,
    ranges: Sequence[tuple[int, int]] | None = None,
) -> list[ShardClient]:
    """Dial every shard in parallel and authenticate; all or nothing.

    ``compression`` (default: none) gives each client its own push codec (and pull codec
    for ``delta+`` specs); ``param_shapes`` lay out the flat vector for PowerSGD;
    ``link`` emulates a slow link on the pushes (see :mod:`sparktrain.wire.link`);
    ``max_frame_bytes`` caps every frame of these connections. Each client can dial its
    shard again after a broken connection. ``ranges`` (default: :func:`shard_ranges` of
    ``num_elements``) are the shards' ranges of the flat vector.
    """
    if ranges is None:
        ranges = shard_ranges(num_elements, len(addresses))
    clients: list[ShardClient | None] = [None] * len(addresses)
    errors: list[BaseException] = []

    def dialer(i: int) -> Callable[[], Connection]:
        def dial_shard() -> Connection:
            conn = connect(
                addresses[i],
                secret=secret,
                job_id=job_id,
                attempt=attempt,
                my_rank=rank,
                peer_rank=DRIVER_RANK,
                timeout=timeout,
                stats=stats,
                link=link,
                security=security,
                max_frame_bytes=max_frame_bytes,
            )
            conn.set_timeout(timeout + REPLY_GRACE_S)
            return conn

        return dial_shard

    def dial(i: int) -> None:
        try:
            conn = dialer(i)()
        except BaseException as exc:  # re-raised below
            errors.append(exc)
            return
        lo, hi = ranges[i]
        codec = pull = None
        if compression is not None:
            codec = compression.push_codec(i, shard_shapes(param_shapes, lo, hi), seed)
            pull = compression.pull_codec(i, seed)
        clients[i] = ShardClient(
            conn,
            index=i,
            lo=lo,
            hi=hi,
            dtype=dtype,
            job_id=job_id,
            attempt=attempt,
            rank=rank,
            codec=codec,
            pull_codec=pull,
            dial=dialer(i),
        )

    threads = [threading.Thread(target=dial, args=(i,), daemon=True) for i in range(len(addresses))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 1.0)
    made = [c for c in clients if c is not None]
    if errors or len(made) != len(addresses):
        for c in made:
            c.close()
        if errors:
            raise errors[0]
        raise PeerLostError(DRIVER_RANK, "the parameter server did not answer in time")
    return made


def shard_shapes(
    param_shapes: Sequence[tuple[int, ...]], lo: int, hi: int
) -> tuple[tuple[int, ...], ...]:
    """The layout of ``[lo, hi)`` of the flat vector (for PowerSGD): the shapes of the
    parameters that lie wholly inside; for a matrix cut by a shard boundary, the whole
    rows inside as a ``(rows, cols)`` matrix and the partial rows as 1-D pieces (empty if
    the shapes are unknown)."""
    if not param_shapes:
        return ()
    out: list[tuple[int, ...]] = []
    offset = 0
    for shape in param_shapes:
        size = math.prod(shape)
        a, b = max(offset, lo) - offset, min(offset + size, hi) - offset
        if a < b:
            if (a, b) == (0, size):
                out.append(tuple(shape))
            elif len(shape) < 2 or shape[0] == 0:
                out.append((b - a,))
            else:
                cols = size // shape[0]
                head = min(-a % cols, b - a)
                rows = (b - a - head) // cols
                tail = b - a - head - rows * cols
                out += [(head,)] * bool(head) + [(rows, cols)] * bool(rows) + [(tail,)] * bool(tail)
        offset += size
    return tuple(out)


def check_compression_table(compression: object, strategy: str = "ps") -> None:
    """Raise :class:`ConfigError` if ``compression`` is a per-layer table: only the
    ring and tree strategies accept one (see the module docstring)."""
    if isinstance(compression, Mapping):
        raise ConfigError(
            f"compression is a per-layer table, which only strategy='ring' and "
            f"strategy='tree' accept; strategy={strategy!r} compresses whole parameter "
            "shards (or payloads), not layers: give one spec string, e.g. "
            "compression='int8+ef'"
        )


class ParameterServerSync:
    """``StepSync`` for ``strategy="ps"``: push gradients, pull parameters, every step."""

    def __init__(self, ctx: WorkerContext, model: nn.Module, mesh: Mesh) -> None:
        spec, cfg = ctx.job, ctx.job.config
        if not spec.ps_addresses:
            raise ConfigError(
                "strategy='ps' but the job carries no parameter-server addresses; "
                "start the job through Trainer.fit"
            )
        check_compression_table(cfg.compression)
        assert isinstance(cfg.compression, str)
        compression = protocol.make_compression(cfg.compression)
        self.rank = ctx.rank
        # sparse tables travel by rows (docs/sparse_ps.md); a sparktrain.run job's server
        # holds the same tables, from rank 0's model (strategies/ps/bootstrap.py)
        named = served_tables(model, cfg.sparse_embeddings)
        self.tables = [p for _, p in named]
        self.params = dense_params(model, named)
        dtype = np.dtype(NUMPY_DTYPES[flat_dtype(self.params + self.tables)])
        n = sum(p.numel() for p in self.params)
        self.flat = np.empty(n, dtype=dtype)
        self.grad = np.empty(n, dtype=dtype)
        self.timeout = cfg.comm_timeout
        # the global step: a resumed stage continues the count the server's ledger keeps
        self.step_index = spec.resume_step or 0
        # the rate of the next push's step from the worker's schedule (NaN: the server's)
        self.lr = math.nan
        self._failed = False
        self._closed = False
        self._step_s = 0.0
        self._hooks: list[Any] = []  # the tables' forward pre-hooks
        self.clients = connect_shards(
            spec.ps_addresses,
            rank=ctx.rank,
            secret=spec.secret,
            job_id=spec.job_id,
            attempt=spec.attempt,
            timeout=cfg.comm_timeout,
            security=spec.security,
            stats=mesh.stats,
            num_elements=n,
            dtype=dtype,
            compression=compression,
            param_shapes=[tuple(p.shape) for p in self.params],
            seed=cfg.seed,
            link=link_from_config(cfg),
            max_frame_bytes=mesh.max_frame_bytes,  # the job's cap, as between ranks
            ranges=dense_ranges(n, len(spec.ps_addresses), bool(self.tables)),
        )
        k = len(self.clients)
        # every shard holds a row range of every table: per table, per shard
        self.table_rows = [row_ranges(int(p.shape[0]), k) for p in self.tables]
        # this step's rows, per shard, per table: (ids, rows)
        self._rows: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(k)]
        self.rows_pushed = 0
        self._hooks += [
            m.register_forward_pre_hook(functools.partial(self._pull_rows, t), with_kwargs=True)
            for t, p in enumerate(self.tables)
            for m in model.modules()
            if isinstance(m, nn.Embedding | nn.EmbeddingBag) and m.weight is p
        ]
        self._pool = (
            cf.ThreadPoolExecutor(k, thread_name_prefix=f"sparktrain-ps-r{ctx.rank}")
            if k > 1
            else None
        )
        self._offsets = np.cumsum([0] + [p.numel() for p in self.params]).tolist()
        self._grad_ptrs: list[int] = []
        self.grad_copies = 0  # gradients copied because their bound view was replaced
        self._bind_grads()
        self._count = 0
        self._futures: dict[int, cf.Future[None]] = {}
        self._armed = False
        self._lock = threading.Lock()
        # overlap needs a second shard to overlap with, and the pool to run it in; with
        # sparse tables every shard holds table rows, whose gradients come last in
        # backward (embeddings are the first layers): nothing would overlap
        self.overlap = bool(cfg.overlap) and self._pool is not None and not self.tables
        self._ready: GradientReadiness | None = None
        self.launched_in_backward = 0  # shard exchanges started from a gradient hook
        try:
            flatten(self.params, self.flat)
            self._each(lambda c: c.pull(-1, self.flat[c.lo : c.hi]))
            unflatten(self.flat, self.params)
            self.set_overlap(self.overlap)
        except BaseException:
            self.close()
            raise

    def set_overlap(self, on: bool) -> bool:
        """Switch overlap on or off between steps (the bench compares both in one run);
        returns whether it is on (never with a single shard)."""
        if self._armed:
            raise RuntimeError("set_overlap between begin_step and step")
        self.overlap = on and self._pool is not None and not self.tables
        if self.overlap and self._ready is None:
            self._ready = GradientReadiness(
                [self._params_in(c.lo, c.hi) for c in self.clients], self._on_ready
            )
        return self.overlap

    def _params_in(self, lo: int, hi: int) -> list[nn.Parameter]:
        """The parameters that overlap ``[lo, hi)`` of the flat vector."""
        off = self._offsets
        return [p for i, p in enumerate(self.params) if off[i] < hi and off[i + 1] > lo]

    def _copy_grads(self, lo: int, hi: int) -> None:
        """Copy the gradients' elements in ``[lo, hi)`` into ``self.grad`` (a missing
        gradient is zeros); shards copy disjoint ranges, so threads may run it at once."""
        out = torch.from_numpy(self.grad)
        off = self._offsets
        with torch.no_grad():
            for i, p in enumerate(self.params):
                a, b = max(lo, off[i]), min(hi, off[i + 1])
                if a >= b:
                    continue
                if p.grad is None:
                    out[a:b].zero_()
                elif p.grad.data_ptr() != self._grad_ptrs[i]:  # not the bound view (replaced)
                    out[a:b].copy_(p.grad.reshape(-1)[a - off[i] : b - off[i]])
                    self.grad_copies += 1

    def _bind_grads(self) -> None:
        """Make every parameter's ``.grad`` a view of ``self.grad``: autograd accumulates
        into it in place, so a push sends the gradients without copying them (a worker
        of a 150M-parameter model keeps three copies of it, not four). A gradient that
        someone replaces later is copied in by :meth:`_copy_grads`."""
        flat = torch.from_numpy(self.grad)
        off = self._offsets
        self._grad_ptrs = []
        with torch.no_grad():
            for i, p in enumerate(self.params):
                view = flat[off[i] : off[i + 1]].view_as(p)
                view.zero_()
                p.grad = view
                self._grad_ptrs.append(view.data_ptr())

    def _exchange(self, c: ShardClient) -> None:
        """Push shard ``c``'s gradient slice of this step, pull its new parameters into
        the flat copy (not the model: backward may still be running)."""
        step, count = self.step_index, self._count
        if count > 0:
            self._copy_grads(c.lo, c.hi)
        rows = self._rows[c.index] if count > 0 else []
        c.push(step, count, self.grad[c.lo : c.hi] if count > 0 else None, lr=self.lr, rows=rows)
        c.pull(step, self.flat[c.lo : c.hi])

    @property
    def cached_params(self) -> list[nn.Parameter]:
        """The sparse tables: this rank's copies are caches of the rows it pulled, not
        replicas of the server's (each rank pulls other rows), so replica checks skip
        them; the driver's model takes the server's tables."""
        return list(self.tables)

    def _split_rows(self, count: int) -> None:
        """Cut every table's gradient into the shards' row ranges for this step's pushes
        (vectorised: one ``searchsorted`` per table)."""
        self._rows = [[] for _ in self.clients]
        for t, p in enumerate(self.tables):
            dim = int(p.shape[1])
            if count > 0 and p.grad is not None:
                if not p.grad.is_sparse:
                    raise ConfigError(
                        f"the sparse embedding of shape {tuple(p.shape)} has a dense gradient "
                        "(replaced after backward?): strategy='ps' sends its touched rows; "
                        "leave its gradient sparse or set sparse_embeddings='off'"
                    )
                ids_t, rows_t = rows_of(p.grad)
                ids = ids_t.cpu().numpy()
                rows = rows_t.detach().cpu().contiguous().numpy()
            else:
                ids = np.empty(0, np.int64)
                rows = np.empty((0, dim), self.flat.dtype)
            ranges = self.table_rows[t]
            cuts = np.searchsorted(ids, [lo for lo, _ in ranges] + [ranges[-1][1]])
            for i, (lo, _) in enumerate(ranges):
                a, b = int(cuts[i]), int(cuts[i + 1])
                self._rows[i].append((ids[a:b] - lo, rows[a:b]))
            self.rows_pushed += len(ids)

    def _pull_rows(
        self, t: int, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """Forward pre-hook of an embedding of table ``t``: fetch the current values of
        the rows this forward will read (its unique ids) into the local table, so a
        forward never reads a stale row; the rest of the local copy is not read."""
        ids = args[0] if args else kwargs.get("input")
        if not isinstance(ids, torch.Tensor) or ids.numel() == 0:
            return
        weight = self.tables[t]
        uniq = torch.unique(ids.detach().reshape(-1)).to("cpu", torch.int64)  # sorted
        if uniq[0] < 0 or uniq[-1] >= weight.shape[0]:
            return  # out of range: the embedding itself raises its clear IndexError
        wanted = uniq.numpy()
        out = np.empty((wanted.size, int(weight.shape[1])), self.flat.dtype)
        ranges = self.table_rows[t]
        cuts = np.searchsorted(wanted, [lo for lo, _ in ranges] + [ranges[-1][1]])

        def fetch(c: ShardClient) -> None:
            a, b = int(cuts[c.index]), int(cuts[c.index + 1])
            if a < b:
                c.pull_rows(t, wanted[a:b] - ranges[c.index][0], out[a:b])

        self._each(fetch)
        with torch.no_grad():
            weight.index_copy_(0, uniq.to(weight.device), torch.from_numpy(out).to(weight.device))

    def refresh_tables(self, block_rows: int = 1 << 16) -> int:
        """Pull every row of every sparse table into this rank's copy (between steps):
        the copy is otherwise a cache of the rows this rank read, stale elsewhere. A
        ``sparktrain.run`` job's rank 0 does it before its train_fn's model leaves (the
        built-in loop's driver takes the server's tables instead). ``block_rows`` rows
        per shard per request bound the memory; returns the rows pulled."""
        pulled = 0
        for t, weight in enumerate(self.tables):
            ranges = self.table_rows[t]
            longest = max(hi - lo for lo, hi in ranges)
            for start in range(0, longest, block_rows):
                spans = [(lo + start, min(hi, lo + start + block_rows)) for lo, hi in ranges]
                outs = [
                    np.empty((max(0, b - a), int(weight.shape[1])), self.flat.dtype)
                    for a, b in spans
                ]
                local = [(a - lo, b - lo) for (a, b), (lo, _) in zip(spans, ranges, strict=True)]
                self._each(functools.partial(self._pull_span, t, local, outs))
                with torch.no_grad():
                    for (a, b), out in zip(spans, outs, strict=True):
                        if a < b:
                            weight[a:b].copy_(torch.from_numpy(out))
                            pulled += b - a
        return pulled

    @staticmethod
    def _pull_span(
        t: int, local: list[tuple[int, int]], outs: list[np.ndarray], c: ShardClient
    ) -> None:
        """Shard ``c``'s rows ``local[c.index]`` (shard-local) of table ``t``."""
        a, b = local[c.index]
        if a < b:
            c.pull_rows(t, np.arange(a, b, dtype=np.int64), outs[c.index])

    def _on_ready(self, index: int) -> None:
        """Hook callback: shard ``index``'s gradients are final; start its exchange."""
        assert self._pool is not None
        with self._lock:
            if self._armed and index not in self._futures and not self._closed:
                self._futures[index] = self._pool.submit(self._exchange, self.clients[index])
                self.launched_in_backward += 1

    def begin_step(self, count: int) -> None:
        """Arm the gradient hooks for a step of ``count`` samples (overlap only)."""
        if not self.overlap or self._ready is None:
            return
        if self._closed:
            raise CommError(f"rank {self.rank}: the parameter-server connections are closed")
        with self._lock:
            self._count = count
            self._futures = {}
            self._armed = True
        self._ready.arm()

    def step(self, count: int) -> None:
        """Push this rank's gradient slices, pull the shards' new parameters."""
        started = time.perf_counter()
        self._split_rows(count)
        if self._ready is None or not self._armed:
            # no overlap, or a step without a batch (begin_step was not called)
            with self._lock:
                self._armed = False
                self._count = count
                self._futures = {}
            self._each(self._exchange)
        else:
            if count != self._count:
                raise ValueError(f"begin_step({self._count}) but step({count}) in one step")
            self._ready.disarm()
            with self._lock:
                self._armed = False
                futures = dict(self._futures)
            self._each(self._exchange, futures)
        unflatten(self.flat, self.params)
        for p in self.params:
            if p.grad is not None:
                p.grad.zero_()
        for p in self.tables:  # sparse: the next backward starts a fresh one
            p.grad = None
        self._rows = [[] for _ in self.clients]
        self.step_index += 1
        self._step_s += time.perf_counter() - started

    def _each(
        self,
        fn: Callable[[ShardClient], object],
        started: dict[int, cf.Future[None]] | None = None,
    ) -> None:
        """Run ``fn`` on every shard concurrently (those in ``started`` are already
        running it); on the first error close all and raise it."""
        if self._closed:
            raise CommError(f"rank {self.rank}: the parameter-server connections are closed")
        try:
            if self._pool is None:
                fn(self.clients[0])
                return
            running = started or {}
            futures: list[cf.Future[Any]] = [
                running[i] if i in running else self._pool.submit(fn, c)
                for i, c in enumerate(self.clients)
            ]
            # Every request is bounded by the socket timeouts; this bound is a backstop.
            done, pending = cf.wait(
                futures, timeout=2 * (self.timeout + REPLY_GRACE_S), return_when=cf.FIRST_EXCEPTION
            )
            first = next((f.exception() for f in futures if f in done and f.exception()), None)
            if first is not None:
                raise first
            if pending:
                raise PeerLostError(
                    DRIVER_RANK, "a parameter-server request did not finish in time"
                )
        except BaseException:
            self._failed = True
            for c in self.clients:  # wakes requests still waiting on other shards
                c.close()
            raise

    @property
    def optimizer(self) -> None:
        """None: the optimizer (and its state) lives on the parameter server."""
        return None

    def stats(self) -> dict[str, Any]:
        """Figures for this rank's stats record."""
        return {
            "overlap": self.overlap,
            "ps_shards_launched_in_backward": self.launched_in_backward,
            "ps_steps": self.step_index,
            "ps_step_s": self._step_s,
            "ps_unchanged_pulls": sum(c.unchanged_pulls for c in self.clients),
            "ps_payload_pulls": sum(c.payload_pulls for c in self.clients),
            "ps_reconnects": sum(c.reconnects for c in self.clients),
            "ps_rows_pushed": self.rows_pushed,
            "ps_rows_pulled": sum(c.rows_pulled for c in self.clients),
            "ps_grad_copies": self.grad_copies,
        }

    def close(self) -> None:
        """Say goodbye to every shard (clean unless a step or the loop failed) and close."""
        if self._closed:
            return
        with self._lock:
            self._closed = True
        if self._ready is not None:
            self._ready.remove()
        for hook in self._hooks:
            hook.remove()
        # Called from the loop's ``finally``: an exception in flight means the loop failed.
        clean = not self._failed and sys.exc_info()[0] is None
        for c in self.clients:
            if not c.conn.closed:
                c.bye(clean)
            c.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
