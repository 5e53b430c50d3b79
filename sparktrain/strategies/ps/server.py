"""The parameter server, hosted in the driver process.

:func:`start_parameter_server` splits the model's flat parameter vector into
``ps_shards`` byte-balanced shards (:mod:`sparktrain.strategies.ps.layout`). Each
:class:`Shard` owns its slice, an optimizer built with the job's optimizer name and
hyper-parameters on that slice, its consistency ledger
(:mod:`sparktrain.strategies.ps.server_consistency`: the sync/async/ssp rules), its
counters (:mod:`sparktrain.strategies.ps.server_stats`) and a listener on the driver
host: a :class:`~sparktrain.wire.service.DriverService`, so strangers go through the same
pre-auth gate as at every driver service, and each worker connection is served on its
handshake's thread. :class:`ParameterServer` is the driver's handle on the shards:
addresses, stage attempts, checkpoints (:mod:`sparktrain.strategies.ps.server_persist`),
the final model and the summary.

Why threads and not processes: the work per request is socket I/O plus a few numpy /
torch vector operations, which release the GIL; threads share the parameters with the
driver, so :meth:`ParameterServer.finish` reads them without another round of IPC, and
:meth:`ParameterServer.stop` can close every socket and join every thread directly. A
shard is still an independent unit (own listener, lock, optimizer and counters), so
moving shards to processes or hosts later changes only how they are started.

Compression (``config.compression``, :mod:`sparktrain.strategies.ps.protocol`): compressed pushes
are decoded into the receive buffer and then treated exactly as plain ones; with a
``delta+`` spec every rank's pull deltas are compressed (one pull codec per rank, the
compression done outside the shard's lock) and the rank's mirror advanced by the
decoded message.

Reconnection: a rank whose connection breaks (reset, closed without a goodbye) may dial
again within ``RECONNECT_GRACE_S`` (at most ``comm_timeout``): the shard drops the old
connection and keeps the rank's state (its last accepted step, its clock); a push the
shard applied before the break and that the worker resends is recognised by its step
number and acknowledged as a duplicate, not applied twice. The worker's first pull on
the new connection fetches the values (its old copy may hold half a delta).

Failures: a rank whose connection drops without a clean goodbye and does not come back
within the grace, or that keeps others waiting longer than ``comm_timeout``, is *lost*.
The first loss is recorded for the whole server and every waiting or later request is
answered with a ``LOST`` status naming that rank, so every other worker fails with a
:class:`PeerLostError` within ``comm_timeout`` (plus a few seconds), never hangs.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from sparktrain.builders import build_optimizer
from sparktrain.config import TrainConfig, single_spec
from sparktrain.errors import CommError, ConfigError, FrameError
from sparktrain.strategies.ps import protocol
from sparktrain.strategies.ps.layout import (
    NUMPY_DTYPES,
    dense_params,
    dense_ranges,
    flat_dtype,
    flatten,
    row_ranges,
    served_tables,
    unflatten,
)
from sparktrain.strategies.ps.server_consistency import (
    AsyncLedger,
    SyncLedger,
    lr_scale,
    make_ledger,
)
from sparktrain.strategies.ps.server_stats import (
    ShardCounters,
    add_to_summary,
    shard_figures,
    summarize,
)
from sparktrain.strategies.ps.server_tables import RowTable, clone_state
from sparktrain.wire.connection import Connection
from sparktrain.wire.frames import HEADER_BYTES, KIND_DATA, MAX_FRAME_BYTES_DEFAULT
from sparktrain.wire.link import link_from_config
from sparktrain.wire.security import WireSecurity
from sparktrain.wire.service import DriverService
from sparktrain.wire.stats import CommStats

if TYPE_CHECKING:
    from sparktrain.result import TrainResult

log = logging.getLogger(__name__)

WAIT_SLICE_S = 0.5  # waits re-check the stop flag and the failure at least this often
JOIN_TIMEOUT_S = 2.0
RECONNECT_GRACE_S = 3.0
"""How long a rank whose connection broke may take to dial again (capped by
``comm_timeout``) before it is declared lost."""


@dataclass
class _RankState:
    """What one shard knows about one rank's connection and pulls (its pushes are in
    the ledger); a new stage attempt starts it afresh."""

    mirror: np.ndarray | None = None  # exact copy of the rank's parameters for this shard
    mirror_version: int = -1
    send_buf: np.ndarray | None = None  # delta being sent (only its handler touches it)
    pull_codec: protocol.CompressorCodec | None = None  # delta+ specs: this rank's pull compressor
    wait_s: float = 0.0
    broken_at: float | None = None  # when its connection broke (None: connected or gone)
    broken_why: str = ""


class Shard(DriverService):
    """One slice ``[lo, hi)`` of the flat parameter vector, served on its own listener."""

    def __init__(self, server: ParameterServer, index: int, lo: int, hi: int, initial: np.ndarray):
        cfg = server.cfg
        self.server = server
        self.index = index
        self.lo, self.hi = lo, hi
        # this shard's rows of every sparse table (docs/sparse_ps.md), in table order
        self.tables = [
            RowTable(name, rlo, rhi, values[rlo:rhi], cfg)
            for name, values in server.table_values
            for rlo, rhi in [row_ranges(values.shape[0], cfg.ps_shards)[index]]
        ]
        self.param = nn.Parameter(torch.from_numpy(initial[lo:hi].copy()))
        self.values: np.ndarray = self.param.data.numpy()  # shares memory with the parameter
        self.optimizer = build_optimizer(
            cfg.optimizer, [self.param], cfg.lr, dict(cfg.optimizer_kwargs)
        )
        self._base_lrs = [float(g["lr"]) for g in self.optimizer.param_groups]
        self._acc = np.zeros_like(self.values)  # sync: sum of n_r * g_r for this step
        self._acc_count = 0.0
        self.param.grad = torch.from_numpy(self._acc)  # the optimizer reads the mean here
        self._grad = self.param.grad
        self.push_codec = server.compression.push_codec()  # decode_into is stateless
        self.ledger = make_ledger(
            cfg.ps_mode, server.world_size, staleness=cfg.staleness, where=f"shard {index}"
        )
        self.cond = threading.Condition()
        self.ranks = {r: _RankState() for r in range(server.world_size)}
        self.counters = ShardCounters()
        self.stats = CommStats()  # every byte of this shard's connections
        self._conns: dict[int, Connection] = {}
        self._threads: list[threading.Thread] = []  # the handlers, joined by join()
        # last: the listener opens once everything else is in place
        super().__init__(
            server.host,
            secret=server.secret,
            job_id=server.job_id,
            attempt=lambda: server.attempt,  # the server moves on to new stage attempts
            security=server.security,
            name=f"ps-{index}",
            stats=self.stats,
            link=link_from_config(cfg),
            max_frame_bytes=server.max_frame_bytes,
        )

    @property
    def elements(self) -> int:
        return self.hi - self.lo

    @property
    def version(self) -> int:
        """sync: steps applied; async/ssp: updates applied."""
        return self.ledger.version

    # ------------------------------------------------------------------ accepting

    def tick(self) -> None:
        self._expire_broken()

    def admit(self, conn: Connection, attempt: int) -> bool:
        """Take ``conn`` as its rank's connection; a rank that dials again replaces its
        old connection (closed here) and keeps its state. False if refused."""
        srv = self.server
        rank = conn.peer_rank
        old = None
        with self.cond:  # begin_attempt() resets the connections under it too
            refuse = srv.stopping or attempt != srv.attempt or rank not in self.ranks
            if not refuse:
                old = self._conns.get(rank)
                state = self.ranks[rank]
                if old is not None or state.broken_at is not None:
                    self.counters.reconnects += 1
                self._conns[rank] = conn
                state.broken_at, state.broken_why = None, ""
                self.cond.notify_all()
        if refuse:
            log.warning("ps shard %d: refused rank %d (unknown or stale)", self.index, rank)
            return False
        if old is not None:
            log.warning(
                "ps shard %d: rank %d reconnected; dropping its old connection", self.index, rank
            )
            old.close()  # its handler sees the error and leaves quietly (no longer current)
        return True

    def handle(self, conn: Connection) -> None:
        """Serve one rank's admitted connection, on its handshake's thread, until it
        says goodbye, breaks, or a new stage attempt or the server's stop ends it."""
        conn.set_timeout(self.server.timeout)  # a worker silent for this long is lost
        me = threading.current_thread()
        me.name = f"sparktrain-ps-{self.index}-rank-{conn.peer_rank}"
        with self.cond:
            self._threads.append(me)
        self._serve(conn)

    def _broken(self, conn: Connection, why: str) -> None:
        """``conn`` broke: if it is still its rank's connection, start the rank's grace
        period to reconnect (a replaced connection breaking means nothing)."""
        with self.cond:
            rank = conn.peer_rank
            if self._conns.get(rank) is not conn:
                return
            del self._conns[rank]
            state = self.ranks[rank]
            if not self.ledger.ranks[rank].done:
                state.broken_at, state.broken_why = time.monotonic(), why
            self.cond.notify_all()

    def _expire_broken(self) -> None:
        """Declare lost every rank whose connection broke longer than the grace ago."""
        srv = self.server
        grace = min(RECONNECT_GRACE_S, srv.timeout)
        now = time.monotonic()
        with self.cond:
            expired = [
                (r, s.broken_why)
                for r, s in self.ranks.items()
                if s.broken_at is not None and now - s.broken_at > grace
            ]
            for r, _ in expired:
                self.ranks[r].broken_at = None
        for rank, why in expired:  # outside our lock: lose() wakes every shard
            srv.lose(rank, why)

    # ------------------------------------------------------------------ serving

    def _serve(self, conn: Connection) -> None:
        srv = self.server
        attempt = srv.attempt  # admit() checked it was the handshake's
        grad = np.empty_like(self.values)  # receive buffer of this rank's pushes
        try:
            while not srv.stopping and srv.attempt == attempt:
                kind, header = conn.recv_bytes(None, max_bytes=protocol.MAX_HEADER_BYTES)
                if kind == protocol.KIND_PUSH and len(header) == protocol.PUSH.size:
                    self._push(conn, header, grad)
                elif kind == protocol.KIND_PULL and len(header) == protocol.PULL.size:
                    self._pull(conn, header)
                elif kind == protocol.KIND_RPULL and len(header) == protocol.RPULL.size:
                    self._row_pull(conn, header)
                elif kind == protocol.KIND_BYE and len(header) == protocol.BYE.size:
                    self._bye(conn, header)
                    return
                else:
                    raise CommError(f"unexpected message kind {kind} ({len(header)} bytes)")
        except (CommError, OSError) as exc:
            if not srv.stopping and srv.attempt == attempt:  # not a connection we closed
                cause = str(exc).split(". The peer's task")[0]  # its advice once, not twice
                self._broken(
                    conn, f"its connection to parameter-server shard {self.index} broke: {cause}"
                )
        finally:
            conn.close()

    def _check(self, attempt: int, rank: int, conn: Connection) -> tuple[int, str]:
        """Status and reason for a request's (attempt, rank) fields."""
        srv = self.server
        if attempt < srv.attempt:
            return protocol.STALE_ATTEMPT, (
                f"rank {rank} sent a request of stage attempt {attempt}, the server is at "
                f"attempt {srv.attempt}: requests of earlier attempts are rejected"
            )
        if attempt != srv.attempt or rank != conn.peer_rank:
            return protocol.PROTOCOL, (
                f"a request claims attempt {attempt} and rank {rank} on the connection "
                f"of rank {conn.peer_rank} (attempt {srv.attempt})"
            )
        return protocol.OK, ""

    def _push(self, conn: Connection, header: bytes, grad: np.ndarray) -> None:
        srv = self.server
        (tag, attempt, rank, step, count, version, has_payload, nbytes, chunk, lr) = (
            protocol.PUSH.unpack(header)
        )
        decode_error = ""
        wire = 0
        if has_payload:  # always read it: the stream must stay in step
            if self.push_codec.compressed:
                if not 0 < nbytes <= protocol.max_message_bytes(self.elements):
                    raise FrameError(f"a compressed push of {nbytes} bytes for {self.elements}")
                blob = np.empty(nbytes, np.uint8)
                frames = protocol.recv_chunked(conn, blob, protocol.KIND_CPAYLOAD, chunk)
                wire = frames * HEADER_BYTES + nbytes
                try:
                    self.push_codec.decode_into(blob, grad)
                except FrameError as exc:
                    decode_error = f"rank {rank}'s compressed push of step {step}: {exc}"
            else:
                if nbytes != grad.nbytes:
                    raise FrameError(f"a push of {nbytes} bytes for a {grad.nbytes}-byte shard")
                frames = protocol.recv_chunked(conn, grad, KIND_DATA, chunk)
                wire = frames * HEADER_BYTES + grad.nbytes
        rows = self._recv_rows(conn, chunk, rank, step) if has_payload else []
        status, reason = self._check(attempt, rank, conn)
        if status == protocol.OK and decode_error:
            status, reason = protocol.PROTOCOL, decode_error
        if status == protocol.OK and tag != srv.job_tag:
            status, reason = protocol.WRONG_JOB, "the push names another job"
        if status == protocol.OK and (count < 0 or (count > 0) != bool(has_payload)):
            status, reason = (
                protocol.PROTOCOL,
                f"a push with count {count} and payload {has_payload}",
            )
        lost = protocol.NO_RANK
        with self.cond:
            if has_payload:
                self.counters.push_raw_bytes += grad.nbytes
                self.counters.push_payload_bytes += wire
                for ids, values, nbytes in rows:
                    self.counters.rows_pushed += len(ids)
                    self.counters.push_raw_bytes += ids.nbytes + values.nbytes
                    self.counters.push_payload_bytes += nbytes
            failure = srv.failure
            if status == protocol.OK and failure is not None:
                status, lost, reason = protocol.LOST, failure[0], failure[1]
            if status == protocol.OK:
                status, reason = self.ledger.check_push(rank, step)
                if status == protocol.DUPLICATE:
                    self.counters.duplicates += 1
            if status == protocol.OK:
                self.ledger.record_push(rank, step)
                self.counters.pushes += 1
                if math.isfinite(lr) and lr > 0:  # the workers' schedule sets the rate
                    self._base_lrs = [lr] * len(self._base_lrs)
                if isinstance(self.ledger, SyncLedger):
                    if count > 0:
                        self._acc += grad * count  # float32 ops as the ring's buckets
                        self._acc_count += count
                        for table, (ids, values, _) in zip(self.tables, rows, strict=True):
                            table.accumulate(torch.from_numpy(ids), values, count)
                    self._maybe_apply_sync()
                else:
                    if count > 0:
                        self._apply_async(grad, version, rank, rows)
                    self.cond.notify_all()  # ssp: this rank's clock moved
            if status not in (protocol.OK, protocol.DUPLICATE):
                self.counters.rejected += 1
            reply_version = self.version
        conn.send_bytes(protocol.ACK.pack(status, lost, reply_version), protocol.KIND_ACK)
        if status not in (protocol.OK, protocol.DUPLICATE):
            conn.send_bytes(reason.encode()[: protocol.MAX_TEXT_BYTES], protocol.KIND_TEXT)

    def _maybe_apply_sync(self) -> None:
        """Apply the current step once every live rank pushed for it (holding ``cond``)."""
        ledger = self.ledger
        assert isinstance(ledger, SyncLedger)
        if not ledger.step_complete():
            return
        if self._acc_count > 0:
            self._grad.div_(self._acc_count)  # the sample-weighted mean, as buckets.py
            for g, base in zip(self.optimizer.param_groups, self._base_lrs, strict=True):
                g["lr"] = base
            self.optimizer.step()
            for table in self.tables:
                table.apply_accumulated(self._acc_count, self._base_lrs)
            self.counters.updates += 1
        ledger.close_step()
        self._acc.fill(0.0)
        self._acc_count = 0.0
        self.cond.notify_all()

    def _apply_async(
        self,
        grad: np.ndarray,
        version: int,
        rank: int,
        rows: list[tuple[np.ndarray, torch.Tensor, int]],
    ) -> None:
        """Apply one rank's gradient (and its table rows) at once, recording its
        staleness (holding ``cond``)."""
        ledger = self.ledger
        assert isinstance(ledger, AsyncLedger)
        stale = ledger.staleness_of(version)
        self.counters.record_staleness(stale)
        np.copyto(self._acc, grad)
        scale = lr_scale(stale, self.server.cfg.staleness_lr)
        groups = self.optimizer.param_groups
        for g, base in zip(groups, self._base_lrs, strict=True):
            g["lr"] = base * scale
        try:
            self.optimizer.step()
            for table, (ids, values, _) in zip(self.tables, rows, strict=True):
                table.apply(torch.from_numpy(ids), values, [b * scale for b in self._base_lrs])
        finally:
            for g, base in zip(groups, self._base_lrs, strict=True):
                g["lr"] = base
        ledger.record_update(rank)
        self.counters.updates += 1

    def _recv_rows(
        self, conn: Connection, chunk: int, rank: int, step: int
    ) -> list[tuple[np.ndarray, torch.Tensor, int]]:
        """Read a push's ``ROWS`` messages, one per table of this shard: per table the
        shard-local ids, their gradient rows and the payload's wire bytes."""
        out = []
        for t, table in enumerate(self.tables):
            _, header = conn.recv_bytes(protocol.KIND_ROWS, max_bytes=protocol.MAX_HEADER_BYTES)
            if len(header) != protocol.ROWS.size:
                raise FrameError(f"a rows header of {len(header)} bytes")
            which, n = protocol.ROWS.unpack(header)
            what = f"rank {rank}'s push of step {step} to table {table.name!r}"
            if which != t:
                raise FrameError(f"{what} came as table {which}, expected {t}")
            ids = protocol.recv_row_ids(conn, n, table.rows, chunk, ascending=True, what=what)
            values = np.empty((n, table.dim), dtype=self.server.dtype)
            frames = protocol.recv_chunked(conn, values.reshape(-1), KIND_DATA, chunk) if n else 0
            nbytes = (frames + (1 if n else 0)) * HEADER_BYTES + ids.nbytes + values.nbytes
            out.append((ids, torch.from_numpy(values), nbytes))
        return out

    def _row_pull(self, conn: Connection, header: bytes) -> None:
        """Answer a ``RPULL``: the current values of the named rows of one table, at once
        (see :mod:`sparktrain.strategies.ps.protocol` for why no wait is needed)."""
        srv = self.server
        attempt, rank, which, n = protocol.RPULL.unpack(header)
        chunk = srv.chunk_bytes
        if not 0 <= which < len(self.tables):
            raise FrameError(
                f"a row pull names table {which}; shard {self.index} holds {len(self.tables)}"
            )
        table = self.tables[which]
        what = f"rank {rank}'s row pull of table {table.name!r}"
        ids = protocol.recv_row_ids(conn, n, table.rows, chunk, ascending=False, what=what)
        status, reason = self._check(attempt, rank, conn)
        lost = protocol.NO_RANK
        values: np.ndarray | None = None
        with self.cond:
            if status == protocol.OK and srv.failure is not None:
                status, (lost, reason) = protocol.LOST, srv.failure
            if status == protocol.OK and srv.stopping:
                status, reason = protocol.STOPPED, "the parameter server is shutting down"
            if status == protocol.OK:
                values = table.gather(torch.from_numpy(ids)).numpy()
                self.counters.row_pulls += 1
                self.counters.rows_pulled += n
        conn.send_bytes(
            protocol.RREPLY.pack(status, lost, n if values is not None else 0, chunk),
            protocol.KIND_RREPLY,
        )
        if values is not None:
            nbytes = protocol.send_rows(conn, values.reshape(-1), None, chunk) if n else 0
            with self.cond:
                self.counters.pull_raw_bytes += values.nbytes
                self.counters.pull_payload_bytes += nbytes
        else:
            conn.send_bytes(reason.encode()[: protocol.MAX_TEXT_BYTES], protocol.KIND_TEXT)

    def _pull(self, conn: Connection, header: bytes) -> None:
        srv = self.server
        attempt, rank, step, have = protocol.PULL.unpack(header)
        status, reason = self._check(attempt, rank, conn)
        lost = protocol.NO_RANK
        encoding, version = protocol.UNCHANGED, -1
        payload: np.ndarray | None = None
        timed_out: tuple[int, str] | None = None
        with self.cond:
            state = self.ranks[conn.peer_rank]
            if status == protocol.OK:
                started = time.monotonic()
                deadline = started + srv.timeout
                while True:
                    if srv.failure is not None:
                        status, (lost, reason) = protocol.LOST, srv.failure
                        break
                    if srv.stopping:
                        status, reason = protocol.STOPPED, "the parameter server is shutting down"
                        break
                    if srv.attempt != attempt:
                        status, reason = protocol.STALE_ATTEMPT, "a newer stage attempt has started"
                        break
                    if self._conns.get(conn.peer_rank) is not conn:
                        # the rank dialed again (and pulls there): this handler must not
                        # touch the rank's mirror any more
                        raise CommError("replaced by the rank's new connection")
                    ready, laggard, why = self.ledger.ready(rank, step)
                    if ready:
                        break
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        timed_out = (laggard, f"{why} within comm_timeout={srv.timeout:g} s")
                        break
                    self.cond.wait(min(remaining, WAIT_SLICE_S))
                state.wait_s += time.monotonic() - started
            if status == protocol.OK and timed_out is None:
                self.counters.pulls += 1
                gap = self.ledger.ssp_gap(step)
                self.counters.max_ssp_gap = max(self.counters.max_ssp_gap, gap)
                encoding, version, payload = self._delta(state, have)
        if timed_out is not None:
            srv.lose(*timed_out)  # outside our lock: lose() wakes every shard
            status, lost, reason = protocol.LOST, *timed_out
        if encoding == protocol.CDELTA:  # compress outside the lock; only this handler uses them
            assert payload is not None and state.pull_codec is not None
            assert state.mirror is not None
            payload = state.pull_codec.encode(payload)
            state.pull_codec.add_into(payload, state.mirror)  # what the worker will do
        nbytes = 0 if payload is None else payload.nbytes
        chunk = srv.chunk_bytes
        conn.send_bytes(
            protocol.REPLY.pack(status, lost, version, encoding, self.elements, nbytes, chunk),
            protocol.KIND_REPLY,
        )
        if payload is not None:
            if encoding == protocol.CDELTA:
                frames = protocol.send_chunked(conn, payload, protocol.KIND_CPAYLOAD, chunk)
                self.stats.add_sent(0, self.values.nbytes)  # the plain delta's bytes
            else:
                frames = protocol.send_chunked(conn, payload, KIND_DATA, chunk)
            with self.cond:
                self.counters.pull_raw_bytes += self.values.nbytes
                self.counters.pull_payload_bytes += frames * HEADER_BYTES + payload.nbytes
        if status != protocol.OK:
            conn.send_bytes(reason.encode()[: protocol.MAX_TEXT_BYTES], protocol.KIND_TEXT)

    def _delta(self, state: _RankState, have: int) -> tuple[int, int, np.ndarray | None]:
        """What a pull sends (holding ``cond``); keeps the rank's mirror exact."""
        if isinstance(self.ledger, SyncLedger) and self.server.compression.pull is None:
            # Exact sync pulls send the values themselves, from the shard's own memory:
            # they cannot change before this rank pushes again (the next step needs its
            # push), so no per-rank mirror and send buffer (two shard copies per rank: GBs
            # for a 150M-parameter model) and the worker's copy is exact.
            if have == self.version:
                self.counters.unchanged_pulls += 1
                return protocol.UNCHANGED, self.version, None
            self.counters.full_pulls += 1
            return protocol.FULL, self.version, self.values
        if state.mirror is None or have != state.mirror_version:
            # first pull (or the worker lost track): the values themselves
            state.mirror = self.values.copy()
            state.mirror_version = self.version
            state.send_buf = np.empty_like(self.values)
            np.copyto(state.send_buf, state.mirror)
            state.pull_codec = self.server.compression.pull_codec(self.index, self.server.cfg.seed)
            self.counters.full_pulls += 1
            return protocol.FULL, self.version, state.send_buf
        if have == self.version:
            self.counters.unchanged_pulls += 1
            return protocol.UNCHANGED, self.version, None
        assert state.send_buf is not None
        np.subtract(self.values, state.mirror, out=state.send_buf)
        state.mirror_version = self.version
        if state.pull_codec is not None:  # compressed and added to the mirror by _pull
            return protocol.CDELTA, self.version, state.send_buf
        state.mirror += state.send_buf  # the same float ops the worker does
        return protocol.DELTA, self.version, state.send_buf

    def _bye(self, conn: Connection, header: bytes) -> None:
        attempt, claimed, clean = protocol.BYE.unpack(header)
        rank = conn.peer_rank
        status, reason = self._check(attempt, claimed, conn)
        if status != protocol.OK:
            log.warning("ps shard %d: ignored a goodbye: %s", self.index, reason)
            return
        if not clean:
            self.server.lose(rank, "its training loop failed")
            return
        with self.cond:
            self.ledger.goodbye(rank)
            self.ranks[rank].broken_at = None
            if isinstance(self.ledger, SyncLedger):
                self._maybe_apply_sync()
            self.cond.notify_all()

    # ------------------------------------------------------------------ lifecycle

    def reset_for_attempt(self) -> None:
        """Forget the previous attempt's connections; keep the parameters, the optimizer
        state, the version and every rank's last accepted step (the server's model and
        ledger survive a stage retry: the new attempt's workers continue the global step
        count, and what a shard already applied comes back as duplicates)."""
        with self.cond:
            conns = list(self._conns.values())
            self._conns.clear()
            self.ranks = {r: _RankState() for r in self.ranks}
            self.ledger.new_attempt()
            for table in self.tables:
                table.clear()
            self._acc.fill(0.0)
            self._acc_count = 0.0
            self.cond.notify_all()
        for conn in conns:
            conn.close()

    def completed_step(self) -> int:
        """The global steps every rank has done on this shard (sync: applied)."""
        with self.cond:
            return self.ledger.completed_step()

    def state(self) -> dict[str, Any]:
        """A consistent copy of what a checkpoint keeps of this shard: parameters,
        optimizer state, version, ledger (tensors and plain values only)."""
        with self.cond:
            return {
                "values": torch.from_numpy(self.values.copy()),
                "optimizer": clone_state(self.optimizer.state_dict()),
                "tables": [t.state() for t in self.tables],
                **self.ledger.state(),
                "staleness": dict(self.counters.staleness),
            }

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state` returned (before any worker connects)."""
        with self.cond:
            values = state["values"].numpy()
            if values.shape != self.values.shape or values.dtype != self.values.dtype:
                raise ConfigError(
                    f"the checkpoint's shard {self.index} holds {values.size} {values.dtype} "
                    f"values, this server's {self.elements} {self.values.dtype}: resume with "
                    "the same model and ps_shards"
                )
            np.copyto(self.values, values)
            self.optimizer.load_state_dict(state["optimizer"])
            tables = state.get("tables", [])
            if len(tables) != len(self.tables):
                raise ConfigError(
                    f"the checkpoint's shard {self.index} holds {len(tables)} sparse tables, "
                    f"this server's {len(self.tables)}: resume with the same model and "
                    "sparse_embeddings"
                )
            for table, table_state in zip(self.tables, tables, strict=True):
                table.load_state(table_state)
            self.ledger.load_state(state)
            self.ranks = {r: _RankState() for r in self.ranks}
            self.counters.staleness.update({int(k): int(v) for k, v in state["staleness"].items()})

    def wake(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def stop(self) -> None:
        """Close every connection (wakes blocked handlers), then the listener; the
        handlers are joined by :meth:`join`."""
        with self.cond:
            conns = list(self._conns.values())
            self.cond.notify_all()
        for conn in conns:
            conn.close()
        super().stop()

    def join(self, deadline: float) -> None:
        """Wait for the handlers until ``deadline`` (``time.monotonic()``)."""
        with self.cond:
            threads = list(self._threads)
        for t in threads:
            if t.is_alive() and t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))

    def snapshot(self) -> dict[str, Any]:
        """This shard's figures for the summary."""
        with self.cond:
            return shard_figures(
                self.counters,
                self.stats.as_dict(),
                index=self.index,
                address=self.address,
                elements=self.elements,
                nbytes=int(self.values.nbytes),
                version=self.version,
                applied=self.ledger.applied_pushes(),
                wait_s={r: s.wait_s for r, s in self.ranks.items()},
            )


class ParameterServer:
    """``ps_shards`` shards of the model's parameters, served from the driver.

    Made by :func:`start_parameter_server`. ``addresses`` (one ``"host:port"`` per
    shard, in shard order) go to the workers in the job spec. :meth:`stop` closes every
    listener, connection and thread (idempotent, bounded); :meth:`finish` loads the
    final parameters into the trained model and adds ``summary["ps"]``.
    """

    def __init__(
        self,
        initial: np.ndarray,
        cfg: TrainConfig,
        *,
        host: str,
        secret: bytes,
        job_id: str,
        attempt: int,
        world_size: int | None = None,
        security: WireSecurity | None = None,
        max_frame_bytes: int = MAX_FRAME_BYTES_DEFAULT,
        chunk_bytes: int | None = None,
        tables: Sequence[tuple[str, np.ndarray]] = (),
    ) -> None:
        # the sparse embedding tables served by rows: (name, [rows, dim] initial values)
        self.table_values = [(name, np.asarray(values)) for name, values in tables]
        self.compression = protocol.make_compression(single_spec(cfg.compression, cfg.strategy))
        self.max_frame_bytes = max_frame_bytes
        # 8: a whole number of float64 (and float32, and uint8) elements per chunk
        self.chunk_bytes = protocol.chunk_size(max_frame_bytes, chunk_bytes, 8)
        self.cfg = cfg
        self.mode = cfg.ps_mode
        self.timeout = cfg.comm_timeout
        self.world_size = world_size if world_size is not None else cfg.num_workers
        self.host = host
        self.secret = bytes(secret)
        self.security = security
        self.job_id = job_id
        self.job_tag = protocol.job_tag(job_id)
        self.attempt = attempt
        self.stopping = False
        self._failure: tuple[int, str] | None = None
        self._lock = threading.Lock()
        self._stopped = False
        self.ranges = dense_ranges(int(initial.size), cfg.ps_shards, bool(self.table_values))
        self.dtype = initial.dtype
        self.shards: list[Shard] = []
        try:
            for i, (lo, hi) in enumerate(self.ranges):
                self.shards.append(Shard(self, i, lo, hi, initial))
        except BaseException:
            self.stop()
            raise
        for shard in self.shards:
            shard.start()
        log.info(
            "parameter server (%s, %d shards, %d elements) at %s",
            self.mode,
            len(self.shards),
            initial.size,
            ", ".join(self.addresses),
        )

    def __enter__(self) -> ParameterServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def addresses(self) -> list[str]:
        """One ``"host:port"`` per shard, in shard order."""
        return [s.address for s in self.shards]

    @property
    def failure(self) -> tuple[int, str] | None:
        """``(lost rank, why)`` once a rank was lost, else None."""
        return self._failure

    def lose(self, rank: int, detail: str) -> None:
        """Record that ``rank`` was lost (the first loss wins) and wake every waiter."""
        with self._lock:
            if self._failure is None and not self.stopping:
                self._failure = (rank, detail)
                log.warning("parameter server: lost rank %d: %s", rank, detail)
        for shard in self.shards:
            shard.wake()

    def begin_attempt(self, attempt: int) -> None:
        """Serve stage attempt ``attempt`` from now on (no-op if it is the current one).

        Connections and requests of earlier attempts are closed and rejected; the lost-rank
        record and every rank's progress are cleared; the parameters, optimizer state and
        versions carry over, so a resubmitted stage continues from the server's model.
        """
        with self._lock:
            if attempt == self.attempt:
                return
            if attempt < self.attempt:
                raise ConfigError(f"attempt {attempt} is older than the current {self.attempt}")
            self.attempt = attempt
            self._failure = None
        for shard in self.shards:  # each handshake reads the attempt when it starts
            shard.reset_for_attempt()
        log.info("parameter server: serving stage attempt %d", attempt)

    def completed_step(self) -> int:
        """The global steps every rank has pushed to every shard (sync: applied): where
        the workers of a new attempt or a resumed run continue. Shards ahead of it take
        the resent steps as duplicates."""
        return min((s.completed_step() for s in self.shards), default=0)

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the server: per shard, a consistent copy of its
        parameters, optimizer state, version and ledger (see
        :mod:`sparktrain.strategies.ps.server_persist`)."""
        return {
            "mode": self.mode,
            "world_size": self.world_size,
            "ranges": [list(r) for r in self.ranges],
            "tables": self.table_shapes(),
            "shards": [s.state() for s in self.shards],
        }

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state` (before the first stage: no worker may be connected)."""
        ranges = [tuple(r) for r in state["ranges"]]
        if ranges != [tuple(r) for r in self.ranges] or state["world_size"] != self.world_size:
            raise ConfigError(
                f"the parameter-server checkpoint has {len(ranges)} shards over "
                f"{ranges[-1][1] if ranges else 0} elements for {state['world_size']} workers; "
                f"this run has {len(self.ranges)} shards over {self.ranges[-1][1]} elements for "
                f"{self.world_size} workers: resume with the same model, ps_shards and "
                "num_workers (or start from scratch with resume=false)"
            )
        tables = [list(t) for t in state.get("tables", [])]
        if tables != self.table_shapes():
            raise ConfigError(
                f"the parameter-server checkpoint holds the sparse tables {tables} "
                f"([name, rows, dim]), this run {self.table_shapes()}: resume with the same "
                "model and sparse_embeddings"
            )
        if state["mode"] != self.mode:
            raise ConfigError(
                f"the parameter-server checkpoint was written in ps_mode={state['mode']!r}, "
                f"this run uses ps_mode={self.mode!r}: resume with the same ps_mode"
            )
        for shard, shard_state in zip(self.shards, state["shards"], strict=True):
            shard.load_state(shard_state)

    def parameters(self) -> np.ndarray:
        """The current flat parameter vector (a copy)."""
        out = np.empty(self.ranges[-1][1] if self.ranges else 0, dtype=self.dtype)
        for shard in self.shards:
            with shard.cond:
                out[shard.lo : shard.hi] = shard.values
        return out

    def table_shapes(self) -> list[list[Any]]:
        """``[name, rows, dim]`` of every table served by rows, in table order."""
        return [[name, int(v.shape[0]), int(v.shape[1])] for name, v in self.table_values]

    def table(self, index: int) -> np.ndarray:
        """The current values of sparse table ``index``, every shard's rows (a copy)."""
        initial = self.table_values[index][1]
        out = np.empty(initial.shape, dtype=self.dtype)
        for shard in self.shards:
            t = shard.tables[index]
            with shard.cond:
                out[t.lo : t.hi] = t.values.numpy()
        return out

    def stop(self) -> None:
        """Close every listener and connection and join the threads; idempotent.

        Bounded: waiting pulls are woken (and answered ``STOPPED``), blocked reads are
        interrupted by closing their sockets; threads get ``JOIN_TIMEOUT_S`` in total.
        """
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            self.stopping = True
        for shard in self.shards:
            shard.stop()
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for shard in self.shards:
            shard.join(deadline)

    def stats(self) -> dict[str, Any]:
        """Per-shard and total figures: pushes, bytes in/out, staleness, waiting
        (:func:`sparktrain.strategies.ps.server_stats.summarize`)."""
        shards = [s.snapshot() for s in self.shards]
        return summarize(shards, self.cfg, world_size=self.world_size, failure=self._failure)

    def finish(self, result: TrainResult) -> None:
        """Make ``result`` describe the server's model.

        Loads the server's parameters (the authoritative ones: in async mode rank 0's copy
        may lag the last pushes of others) into ``result.model``, adds ``summary["ps"]``
        (:meth:`stats`), and adds the server's sent bytes to ``bytes_sent``/``wire_bytes``:
        workers count what they push, the server what it sends back, so the totals cover
        both directions, as the ring's cover every rank's sends.
        """
        tables = []
        if self.table_values:
            tables = served_tables(result.model, self.cfg.sparse_embeddings)
        if [name for name, _ in tables] != [name for name, _ in self.table_values]:
            raise ConfigError(
                f"the result's model has the sparse tables {[n for n, _ in tables]}, the "
                f"parameter server {[n for n, _ in self.table_values]}: not the model the "
                "server was started with"
            )
        params = dense_params(result.model, tables)
        flat = self.parameters()
        if sum(p.numel() for p in params) != flat.size:
            raise ConfigError(
                f"the result's model has {sum(p.numel() for p in params)} trainable elements, "
                f"the parameter server {flat.size}: not the model the server was started with"
            )
        unflatten(flat, params)
        with torch.no_grad():  # the server's tables, not rank 0's partly stale copies
            for i, (_, weight) in enumerate(tables):
                weight.copy_(torch.from_numpy(self.table(i)))
        add_to_summary(result.summary, self.stats())


def start_parameter_server(
    model: nn.Module,
    cfg: TrainConfig,
    *,
    host: str,
    secret: bytes,
    job_id: str,
    attempt: int,
    world_size: int | None = None,
    security: WireSecurity | None = None,
    max_frame_bytes: int = MAX_FRAME_BYTES_DEFAULT,
    chunk_bytes: int | None = None,
) -> ParameterServer:
    """Start a server holding ``model``'s trainable parameters, listening on ``host``.

    ``model`` is the driver's freshly built model (same seed, same initial weights as the
    workers'; workers still take the server's values on their first pull). Raises
    :class:`ConfigError` for a model the PS cannot shard (mixed dtypes, more shards than
    elements). ``world_size`` defaults to ``cfg.num_workers``. ``max_frame_bytes`` caps
    every frame of the server's connections and ``chunk_bytes`` (default
    :data:`~sparktrain.strategies.ps.protocol.CHUNK_BYTES_DEFAULT`, at most the cap) sizes the
    chunks payloads travel in (tests inject tiny ones).
    """
    tables = served_tables(model, cfg.sparse_embeddings)
    params = dense_params(model, tables)
    dtype = flat_dtype(params + [p for _, p in tables])
    flat = np.empty(sum(p.numel() for p in params), dtype=NUMPY_DTYPES[dtype])
    flatten(params, flat)
    return ParameterServer(
        flat,
        cfg,
        host=host,
        secret=secret,
        job_id=job_id,
        attempt=attempt,
        world_size=world_size,
        security=security,
        max_frame_bytes=max_frame_bytes,
        chunk_bytes=chunk_bytes,
        tables=[(name, p.detach().numpy().copy()) for name, p in tables],
    )
