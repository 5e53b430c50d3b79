"""The parameter server, hosted in the driver process.

:func:`start_parameter_server` splits the model's flat parameter vector into
``ps_shards`` byte-balanced shards (:mod:`sparktrain.ps.layout`). Each :class:`Shard`
owns its slice, an optimizer built with the job's optimizer name and hyper-parameters
on that slice, a listener on the driver host and one handler thread per worker
connection.

Why threads and not processes: the work per request is socket I/O plus a few numpy /
torch vector operations, which release the GIL; threads share the parameters with the
driver, so :meth:`ParameterServer.finish` reads them without another round of IPC, and
:meth:`ParameterServer.stop` can close every socket and join every thread directly. A
shard is still an independent unit (own listener, lock, optimizer and counters), so
moving shards to processes or hosts later changes only how they are started.

Modes (``ps_mode``):

* ``sync`` — a shard accumulates ``sum(n_r * g_r)`` and ``sum(n_r)`` for the current
  step; once every live rank has pushed for it (count 0 included) it applies the
  optimizer to the sample-weighted mean, exactly the ring's rule (worker/buckets.py).
  A pull for step ``t`` waits until step ``t`` is applied.
* ``async`` — every push with samples is applied at once (Downpour/Hogwild); its
  staleness is the shard's version minus the version the worker computed on.
* ``ssp`` — as async, but a rank that has pushed ``c`` steps waits on its pull until
  the slowest live rank has pushed at least ``c - staleness`` steps.

With ``staleness_lr`` a push of staleness ``k`` is applied with the learning rate
scaled by ``1/(1 + k)`` (the step is scaled, whatever the optimizer).

Compression (``config.compression``, :mod:`sparktrain.ps.protocol`): compressed pushes
are decoded into the receive buffer and then treated exactly as plain ones; with a
``delta+`` spec every rank's pull deltas are compressed (one pull codec per rank, the
compression done outside the shard's lock) and the rank's mirror advanced by the
decoded message. Bytes are counted per direction: *push* is everything the workers send
a shard (wire) against the uncompressed gradient slices their pushes stand for (raw);
*pull* is everything a shard sends back against the uncompressed values/deltas.

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

import contextlib
import logging
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from sparktrain.comm.connection import Connection
from sparktrain.comm.frames import HEADER_BYTES, KIND_DATA, MAX_FRAME_BYTES_DEFAULT
from sparktrain.comm.handshake import DRIVER_RANK, first_bytes, serve_accepted
from sparktrain.comm.link import link_from_config
from sparktrain.comm.listen import address_of, open_listener
from sparktrain.comm.preauth import PreauthGate, notify_observer
from sparktrain.comm.security import WireSecurity
from sparktrain.comm.stats import CommStats
from sparktrain.config import TrainConfig, single_spec
from sparktrain.errors import CommError, ConfigError, FrameError
from sparktrain.modeling import build_optimizer
from sparktrain.ps import protocol as P
from sparktrain.ps.layout import (
    NUMPY_DTYPES,
    flat_dtype,
    flatten,
    shard_ranges,
    trainable,
    unflatten,
)

if TYPE_CHECKING:
    from sparktrain.result import TrainResult

log = logging.getLogger(__name__)

ACCEPT_POLL_S = 0.2  # how often an accept loop looks at the stop flag
WAIT_SLICE_S = 0.5  # waits re-check the stop flag and the failure at least this often
HANDSHAKE_TIMEOUT_S = 10.0  # begin_attempt() waits at most this (+ a poll) for re-arming
JOIN_TIMEOUT_S = 2.0
STALENESS_BINS = 32  # the histogram keeps staleness 0..31 exactly, the rest as "32+"
RECONNECT_GRACE_S = 3.0
"""How long a rank whose connection broke may take to dial again (capped by
``comm_timeout``) before it is declared lost."""


@dataclass
class _RankState:
    """What one shard knows about one rank."""

    last_step: int = -1  # highest global step pushed and accepted (kept across attempts)
    applied: int = 0  # pushes with samples applied (async/ssp; checkpointed)
    done: bool = False  # said a clean goodbye: no longer expected to push
    mirror: np.ndarray | None = None  # exact copy of the rank's parameters for this shard
    mirror_version: int = -1
    send_buf: np.ndarray | None = None  # delta being sent (only its handler touches it)
    pull_codec: P.CompressorCodec | None = None  # delta+ specs: this rank's pull compressor
    wait_s: float = 0.0
    connected: bool = False
    broken_at: float | None = None  # when its connection broke (None: connected or gone)
    broken_why: str = ""

    @property
    def clock(self) -> int:
        """Steps pushed."""
        return self.last_step + 1


@dataclass
class _Counters:
    pushes: int = 0
    duplicates: int = 0
    reconnects: int = 0
    rejected: int = 0
    pulls: int = 0
    unchanged_pulls: int = 0
    full_pulls: int = 0
    updates: int = 0
    staleness: Counter[int] = field(default_factory=Counter)
    max_ssp_gap: int = 0
    push_raw_bytes: int = 0  # uncompressed size of the gradient slices received
    push_payload_bytes: int = 0  # their frames on the wire (headers included)
    pull_raw_bytes: int = 0  # uncompressed size of the values/deltas sent
    pull_payload_bytes: int = 0


class Shard:
    """One slice ``[lo, hi)`` of the flat parameter vector, served on its own listener."""

    def __init__(self, server: ParameterServer, index: int, lo: int, hi: int, initial: np.ndarray):
        cfg = server.cfg
        self.server = server
        self.index = index
        self.lo, self.hi = lo, hi
        self.param = nn.Parameter(torch.from_numpy(initial[lo:hi].copy()))
        self.values: np.ndarray = self.param.data.numpy()  # shares memory with the parameter
        self.optimizer = build_optimizer(
            cfg.optimizer, [self.param], cfg.lr, dict(cfg.optimizer_kwargs)
        )
        self._base_lrs = [float(g["lr"]) for g in self.optimizer.param_groups]
        self._acc = np.zeros_like(self.values)  # sync: sum of n_r * g_r for this step
        self._acc_count = 0.0
        self._pushed: set[int] = set()
        self.param.grad = torch.from_numpy(self._acc)  # the optimizer reads the mean here
        self._grad = self.param.grad
        self.push_codec = server.compression.push_codec()  # decode_into is stateless
        self.version = 0  # sync: steps applied; async/ssp: updates applied
        self.applied = 0  # sync: steps completed (by step number); async/ssp: pushes applied
        self.cond = threading.Condition()
        self.ranks = {r: _RankState() for r in range(server.world_size)}
        self.counters = _Counters()
        self.stats = CommStats()  # every byte of this shard's connections
        self._conns: dict[int, Connection] = {}
        self._threads: list[threading.Thread] = []
        self.listener = open_listener(server.host)
        self.address = address_of(self.listener)
        self.armed_attempt = server.attempt
        self._gate = PreauthGate(
            self.listener,
            name=f"ps-{index}",
            handshake=self._handshake,
            on_ready=self._adopt,
            first_bytes=first_bytes(server.security),
            poll_s=ACCEPT_POLL_S,
        )
        self._acceptor = threading.Thread(
            target=self._accept_loop, name=f"sparktrain-ps-accept-{index}", daemon=True
        )

    @property
    def elements(self) -> int:
        return self.hi - self.lo

    def start(self) -> None:
        self._acceptor.start()
        notify_observer("listener", self.address)

    # ------------------------------------------------------------------ accepting

    def _accept_loop(self) -> None:
        srv = self.server
        while not srv.stopping:
            self._expire_broken()
            self.armed_attempt = srv.attempt  # begin_attempt() waits for this
            try:  # handshakes run off this thread, under the pre-auth gate
                self._gate.step()
            except OSError as exc:
                if srv.stopping:
                    return
                log.warning("ps shard %d: accept failed: %s", self.index, exc)
                time.sleep(0.05)

    def _handshake(
        self, sock: socket.socket, deadline: float, authenticated: Callable[[], bool]
    ) -> tuple[int, Connection]:
        srv = self.server
        attempt = srv.attempt  # read when the handshake starts: a new attempt is armed at once
        return attempt, serve_accepted(
            sock,
            secret=srv.secret,
            job_id=srv.job_id,
            attempt=attempt,
            my_rank=DRIVER_RANK,
            deadline=deadline,
            stats=self.stats,
            accept_rank=lambda _rank: authenticated(),
            timeout=srv.timeout,
            link=link_from_config(srv.cfg),
            security=srv.security,
            max_frame_bytes=srv.max_frame_bytes,
        )

    def _adopt(self, accepted: tuple[int, Connection]) -> None:
        attempt, conn = accepted
        if not self._admit(conn, attempt):
            return
        conn.set_timeout(self.server.timeout)  # a worker silent for this long is lost
        t = threading.Thread(
            target=self._serve,
            args=(conn,),
            name=f"sparktrain-ps-{self.index}-rank-{conn.peer_rank}",
            daemon=True,
        )
        self._threads.append(t)
        t.start()

    def _admit(self, conn: Connection, attempt: int) -> bool:
        """Take ``conn`` as its rank's connection; a rank that dials again replaces its
        old connection (closed here) and keeps its state. False if refused."""
        srv = self.server
        rank = conn.peer_rank
        old = None
        with self.cond:
            refuse = srv.stopping or attempt != srv.attempt or rank not in self.ranks
            if not refuse:
                old = self._conns.get(rank)
                state = self.ranks[rank]
                if old is not None or state.broken_at is not None:
                    self.counters.reconnects += 1
                self._conns[rank] = conn
                state.connected = True
                state.broken_at, state.broken_why = None, ""
                self.cond.notify_all()
        if refuse:
            log.warning("ps shard %d: refused rank %d (unknown or stale)", self.index, rank)
            conn.close()
            return False
        if old is not None:
            log.warning(
                "ps shard %d: rank %d reconnected; dropping its old connection", self.index, rank
            )
            old.close()  # its handler sees the error and leaves quietly (no longer current)
        return True

    def _broken(self, conn: Connection, why: str) -> None:
        """``conn`` broke: if it is still its rank's connection, start the rank's grace
        period to reconnect (a replaced connection breaking means nothing)."""
        with self.cond:
            rank = conn.peer_rank
            if self._conns.get(rank) is not conn:
                return
            del self._conns[rank]
            state = self.ranks[rank]
            state.connected = False
            if not state.done:
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
        attempt = srv.attempt  # the handshake proved it
        grad = np.empty_like(self.values)  # receive buffer of this rank's pushes
        try:
            while not srv.stopping and srv.attempt == attempt:
                kind, header = conn.recv_bytes(None, max_bytes=P.MAX_HEADER_BYTES)
                if kind == P.KIND_PUSH and len(header) == P.PUSH.size:
                    self._push(conn, header, grad)
                elif kind == P.KIND_PULL and len(header) == P.PULL.size:
                    self._pull(conn, header)
                elif kind == P.KIND_BYE and len(header) == P.BYE.size:
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
            return P.STALE_ATTEMPT, (
                f"rank {rank} sent a request of stage attempt {attempt}, the server is at "
                f"attempt {srv.attempt}: requests of earlier attempts are rejected"
            )
        if attempt != srv.attempt or rank != conn.peer_rank:
            return P.PROTOCOL, (
                f"a request claims attempt {attempt} and rank {rank} on the connection "
                f"of rank {conn.peer_rank} (attempt {srv.attempt})"
            )
        return P.OK, ""

    def _push(self, conn: Connection, header: bytes, grad: np.ndarray) -> None:
        srv = self.server
        tag, attempt, rank, step, count, version, has_payload, nbytes, chunk = P.PUSH.unpack(header)
        decode_error = ""
        wire = 0
        if has_payload:  # always read it: the stream must stay in step
            if self.push_codec.compressed:
                if not 0 < nbytes <= P.max_message_bytes(self.elements):
                    raise FrameError(f"a compressed push of {nbytes} bytes for {self.elements}")
                blob = np.empty(nbytes, np.uint8)
                frames = P.recv_chunked(conn, blob, P.KIND_CPAYLOAD, chunk)
                wire = frames * HEADER_BYTES + nbytes
                try:
                    self.push_codec.decode_into(blob, grad)
                except FrameError as exc:
                    decode_error = f"rank {rank}'s compressed push of step {step}: {exc}"
            else:
                if nbytes != grad.nbytes:
                    raise FrameError(f"a push of {nbytes} bytes for a {grad.nbytes}-byte shard")
                frames = P.recv_chunked(conn, grad, KIND_DATA, chunk)
                wire = frames * HEADER_BYTES + grad.nbytes
        status, reason = self._check(attempt, rank, conn)
        if status == P.OK and decode_error:
            status, reason = P.PROTOCOL, decode_error
        if status == P.OK and tag != srv.job_tag:
            status, reason = P.WRONG_JOB, "the push names another job"
        if status == P.OK and (count < 0 or (count > 0) != bool(has_payload)):
            status, reason = P.PROTOCOL, f"a push with count {count} and payload {has_payload}"
        lost = P.NO_RANK
        with self.cond:
            if has_payload:
                self.counters.push_raw_bytes += grad.nbytes
                self.counters.push_payload_bytes += wire
            failure = srv.failure
            if status == P.OK and failure is not None:
                status, lost, reason = P.LOST, failure[0], failure[1]
            state = self.ranks[conn.peer_rank]
            if status == P.OK:
                if step <= state.last_step:
                    status = P.DUPLICATE
                    self.counters.duplicates += 1
                elif step != state.last_step + 1:
                    status, reason = (
                        P.PROTOCOL,
                        (f"rank {rank} pushed step {step} after step {state.last_step}"),
                    )
                elif srv.mode == "sync" and step != self.version:
                    status, reason = (
                        P.PROTOCOL,
                        (
                            f"rank {rank} pushed step {step} while shard {self.index} is at "
                            f"step {self.version}"
                        ),
                    )
                else:
                    state.last_step = step
                    self.counters.pushes += 1
                    if srv.mode == "sync":
                        if count > 0:
                            self._acc += grad * count  # float32 ops as the ring's buckets
                            self._acc_count += count
                        self._pushed.add(rank)
                        self._maybe_apply_sync()
                    else:
                        if count > 0:
                            self._apply_async(grad, version)
                            state.applied += 1
                        self.cond.notify_all()  # ssp: this rank's clock moved
            if status not in (P.OK, P.DUPLICATE):
                self.counters.rejected += 1
            reply_version = self.version
        conn.send_bytes(P.ACK.pack(status, lost, reply_version), P.KIND_ACK)
        if status not in (P.OK, P.DUPLICATE):
            conn.send_bytes(reason.encode()[: P.MAX_TEXT_BYTES], P.KIND_TEXT)

    def _maybe_apply_sync(self) -> None:
        """Apply the current step once every live rank pushed for it (holding ``cond``)."""
        live = {r for r, s in self.ranks.items() if not s.done}
        if not self._pushed or not live <= self._pushed:
            return
        if self._acc_count > 0:
            self._grad.div_(self._acc_count)  # the sample-weighted mean, as buckets.py
            self.optimizer.step()
            self.counters.updates += 1
        # the steps completed, by the step number the ranks pushed (the ledger), not by
        # the version counter: a step applied twice would make the two differ
        self.applied = 1 + max(self.ranks[r].last_step for r in self._pushed)
        self._acc.fill(0.0)
        self._acc_count = 0.0
        self._pushed.clear()
        self.version += 1
        self.cond.notify_all()

    def _apply_async(self, grad: np.ndarray, version: int) -> None:
        """Apply one rank's gradient at once, recording its staleness (holding ``cond``)."""
        stale = max(0, self.version - version)
        self.counters.staleness[min(stale, STALENESS_BINS)] += 1
        np.copyto(self._acc, grad)
        scale = 1.0 / (1 + stale) if self.server.cfg.staleness_lr else 1.0
        groups = self.optimizer.param_groups
        if scale != 1.0:
            for g, base in zip(groups, self._base_lrs, strict=True):
                g["lr"] = base * scale
        try:
            self.optimizer.step()
        finally:
            if scale != 1.0:
                for g, base in zip(groups, self._base_lrs, strict=True):
                    g["lr"] = base
        self.version += 1
        self.counters.updates += 1

    def _ready(self, rank: int, step: int) -> tuple[bool, int, str]:
        """May a pull by ``rank`` after pushing ``step`` be answered? (ready, laggard, why)."""
        srv = self.server
        if step < 0 or srv.mode == "async":
            return True, P.NO_RANK, ""
        live = [r for r, s in self.ranks.items() if not s.done]
        if srv.mode == "sync":
            if self.version > step:
                return True, P.NO_RANK, ""
            missing = sorted(set(live) - self._pushed)
            laggard = missing[0] if missing else P.NO_RANK
            return False, laggard, f"it did not push step {step}"
        # ssp
        if not live:
            return True, P.NO_RANK, ""
        slowest = min(live, key=lambda r: self.ranks[r].clock)
        need = step + 1 - srv.staleness
        if self.ranks[slowest].clock >= need:
            return True, P.NO_RANK, ""
        return False, slowest, f"it stayed more than {srv.staleness} steps behind (step {step})"

    def _pull(self, conn: Connection, header: bytes) -> None:
        srv = self.server
        attempt, rank, step, have = P.PULL.unpack(header)
        status, reason = self._check(attempt, rank, conn)
        lost = P.NO_RANK
        encoding, version = P.UNCHANGED, -1
        payload: np.ndarray | None = None
        timed_out: tuple[int, str] | None = None
        with self.cond:
            state = self.ranks[conn.peer_rank]
            if status == P.OK:
                started = time.monotonic()
                deadline = started + srv.timeout
                while True:
                    if srv.failure is not None:
                        status, (lost, reason) = P.LOST, srv.failure
                        break
                    if srv.stopping:
                        status, reason = P.STOPPED, "the parameter server is shutting down"
                        break
                    if srv.attempt != attempt:
                        status, reason = P.STALE_ATTEMPT, "a newer stage attempt has started"
                        break
                    if self._conns.get(conn.peer_rank) is not conn:
                        # the rank dialed again (and pulls there): this handler must not
                        # touch the rank's mirror any more
                        raise CommError("replaced by the rank's new connection")
                    ready, laggard, why = self._ready(rank, step)
                    if ready:
                        break
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        timed_out = (laggard, f"{why} within comm_timeout={srv.timeout:g} s")
                        break
                    self.cond.wait(min(remaining, WAIT_SLICE_S))
                state.wait_s += time.monotonic() - started
            if status == P.OK and timed_out is None:
                self.counters.pulls += 1
                if srv.mode == "ssp" and step >= 0:
                    live = [s.clock for s in self.ranks.values() if not s.done]
                    gap = step + 1 - min(live, default=step + 1)
                    self.counters.max_ssp_gap = max(self.counters.max_ssp_gap, gap)
                encoding, version, payload = self._delta(state, have)
        if timed_out is not None:
            srv.lose(*timed_out)  # outside our lock: lose() wakes every shard
            status, lost, reason = P.LOST, *timed_out
        if encoding == P.CDELTA:  # compress outside the lock; only this handler uses them
            assert payload is not None and state.pull_codec is not None
            assert state.mirror is not None
            payload = state.pull_codec.encode(payload)
            state.pull_codec.add_into(payload, state.mirror)  # what the worker will do
        nbytes = 0 if payload is None else payload.nbytes
        chunk = srv.chunk_bytes
        conn.send_bytes(
            P.REPLY.pack(status, lost, version, encoding, self.elements, nbytes, chunk),
            P.KIND_REPLY,
        )
        if payload is not None:
            if encoding == P.CDELTA:
                frames = P.send_chunked(conn, payload, P.KIND_CPAYLOAD, chunk)
                self.stats.add_sent(0, self.values.nbytes)  # the plain delta's bytes
            else:
                frames = P.send_chunked(conn, payload, KIND_DATA, chunk)
            with self.cond:
                self.counters.pull_raw_bytes += self.values.nbytes
                self.counters.pull_payload_bytes += frames * HEADER_BYTES + payload.nbytes
        if status != P.OK:
            conn.send_bytes(reason.encode()[: P.MAX_TEXT_BYTES], P.KIND_TEXT)

    def _delta(self, state: _RankState, have: int) -> tuple[int, int, np.ndarray | None]:
        """What a pull sends (holding ``cond``); keeps the rank's mirror exact."""
        if self.server.mode == "sync" and self.server.compression.pull is None:
            # Exact sync pulls send the values themselves, from the shard's own memory:
            # they cannot change before this rank pushes again (the next step needs its
            # push), so no per-rank mirror and send buffer (two shard copies per rank: GBs
            # for a 150M-parameter model) and the worker's copy is exact.
            if have == self.version:
                self.counters.unchanged_pulls += 1
                return P.UNCHANGED, self.version, None
            self.counters.full_pulls += 1
            return P.FULL, self.version, self.values
        if state.mirror is None or have != state.mirror_version:
            # first pull (or the worker lost track): the values themselves
            state.mirror = self.values.copy()
            state.mirror_version = self.version
            state.send_buf = np.empty_like(self.values)
            np.copyto(state.send_buf, state.mirror)
            state.pull_codec = self.server.compression.pull_codec(self.index, self.server.cfg.seed)
            self.counters.full_pulls += 1
            return P.FULL, self.version, state.send_buf
        if have == self.version:
            self.counters.unchanged_pulls += 1
            return P.UNCHANGED, self.version, None
        assert state.send_buf is not None
        np.subtract(self.values, state.mirror, out=state.send_buf)
        state.mirror_version = self.version
        if state.pull_codec is not None:  # compressed and added to the mirror by _pull
            return P.CDELTA, self.version, state.send_buf
        state.mirror += state.send_buf  # the same float ops the worker does
        return P.DELTA, self.version, state.send_buf

    def _bye(self, conn: Connection, header: bytes) -> None:
        attempt, claimed, clean = P.BYE.unpack(header)
        rank = conn.peer_rank
        status, reason = self._check(attempt, claimed, conn)
        if status != P.OK:
            log.warning("ps shard %d: ignored a goodbye: %s", self.index, reason)
            return
        if not clean:
            self.server.lose(rank, "its training loop failed")
            return
        with self.cond:
            self.ranks[rank].done = True
            self.ranks[rank].broken_at = None
            if self.server.mode == "sync":
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
            self.ranks = {r: self._carried(s) for r, s in self.ranks.items()}
            self._acc.fill(0.0)
            self._acc_count = 0.0
            self._pushed.clear()
            self.cond.notify_all()
        for conn in conns:
            conn.close()

    def _carried(self, state: _RankState) -> _RankState:
        """What a rank's state carries into a new attempt (or a checkpoint): in sync
        mode the steps of the unfinished step are dropped (its partial sum was), so
        the rank pushes that step again."""
        last = (
            min(state.last_step, self.version - 1)
            if self.server.mode == "sync"
            else (state.last_step)
        )
        return _RankState(last_step=last, applied=state.applied)

    def completed_step(self) -> int:
        """The global steps every rank has done on this shard (sync: applied)."""
        with self.cond:
            if self.server.mode == "sync":
                return self.version
            return min((s.clock for s in self.ranks.values()), default=0)

    def state(self) -> dict[str, Any]:
        """A consistent copy of what a checkpoint keeps of this shard: parameters,
        optimizer state, version, ledger (tensors and plain values only)."""
        with self.cond:
            carried = [self._carried(s) for s in self.ranks.values()]
            return {
                "values": torch.from_numpy(self.values.copy()),
                "optimizer": _clone(self.optimizer.state_dict()),
                "version": self.version,
                "applied": self.applied,
                "last_steps": [s.last_step for s in carried],
                "rank_applied": [s.applied for s in carried],
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
            self.version = int(state["version"])
            self.applied = int(state["applied"])
            for r, (last, applied) in enumerate(
                zip(state["last_steps"], state["rank_applied"], strict=True)
            ):
                self.ranks[r] = _RankState(last_step=int(last), applied=int(applied))
            self.counters.staleness.update({int(k): int(v) for k, v in state["staleness"].items()})

    def wake(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def close(self) -> None:
        """Close the listener and every connection (wakes blocked handlers)."""
        self._gate.close()
        with contextlib.suppress(OSError):
            self.listener.close()
        with self.cond:
            conns = list(self._conns.values())
            self.cond.notify_all()
        for conn in conns:
            conn.close()

    def join(self, deadline: float) -> None:
        for t in [self._acceptor, *self._threads]:
            if t.is_alive() and t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))

    def snapshot(self) -> dict[str, Any]:
        """This shard's figures for the summary."""
        with self.cond:
            c = self.counters
            comm = self.stats.as_dict()
            return {
                "index": self.index,
                "address": self.address,
                "elements": self.elements,
                "bytes": int(self.values.nbytes),
                "version": self.version,
                "applied": self.applied
                if self.server.mode == "sync"
                else sum(s.applied for s in self.ranks.values()),
                "updates": c.updates,
                "pushes": c.pushes,
                "duplicates": c.duplicates,
                "reconnects": c.reconnects,
                "rejected": c.rejected,
                "pulls": c.pulls,
                "unchanged_pulls": c.unchanged_pulls,
                "full_pulls": c.full_pulls,
                "bytes_in": comm["wire_bytes_recv"],
                "bytes_out": comm["wire_bytes_sent"],
                "raw_bytes_out": comm["raw_bytes_sent"],
                "push_raw_bytes": c.push_raw_bytes,
                "push_payload_bytes": c.push_payload_bytes,
                "pull_raw_bytes": c.pull_raw_bytes,
                "pull_payload_bytes": c.pull_payload_bytes,
                "staleness_hist": dict(sorted(c.staleness.items())),
                "max_ssp_gap": c.max_ssp_gap,
                "wait_s": {r: s.wait_s for r, s in self.ranks.items()},
            }


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
    ) -> None:
        self.compression = P.make_compression(single_spec(cfg.compression, cfg.strategy))
        self.max_frame_bytes = max_frame_bytes
        # 8: a whole number of float64 (and float32, and uint8) elements per chunk
        self.chunk_bytes = P.chunk_size(max_frame_bytes, chunk_bytes, 8)
        self.cfg = cfg
        self.mode = cfg.ps_mode
        self.staleness = cfg.staleness
        self.timeout = cfg.comm_timeout
        self.world_size = world_size if world_size is not None else cfg.num_workers
        self.host = host
        self.secret = bytes(secret)
        self.security = security
        self.job_id = job_id
        self.job_tag = P.job_tag(job_id)
        self.attempt = attempt
        self.stopping = False
        self._failure: tuple[int, str] | None = None
        self._lock = threading.Lock()
        self._stopped = False
        self.ranges = shard_ranges(int(initial.size), cfg.ps_shards)
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
        for shard in self.shards:
            shard.reset_for_attempt()
        # Each accept loop handshakes with the attempt it read before waiting; let them all
        # re-arm with the new one so that the new attempt's first dials are not refused.
        deadline = time.monotonic() + ACCEPT_POLL_S + HANDSHAKE_TIMEOUT_S
        while time.monotonic() < deadline and any(s.armed_attempt != attempt for s in self.shards):
            time.sleep(0.01)
        log.info("parameter server: serving stage attempt %d", attempt)

    def completed_step(self) -> int:
        """The global steps every rank has pushed to every shard (sync: applied): where
        the workers of a new attempt or a resumed run continue. Shards ahead of it take
        the resent steps as duplicates."""
        return min((s.completed_step() for s in self.shards), default=0)

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the server: per shard, a consistent copy of its
        parameters, optimizer state, version and ledger (see :mod:`sparktrain.ps.persist`)."""
        return {
            "mode": self.mode,
            "world_size": self.world_size,
            "ranges": [list(r) for r in self.ranges],
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
            shard.close()
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for shard in self.shards:
            shard.join(deadline)

    def stats(self) -> dict[str, Any]:
        """Per-shard and total figures: pushes, bytes in/out, staleness, waiting."""
        shards = [s.snapshot() for s in self.shards]
        hist: Counter[int] = Counter()
        for s in shards:
            hist.update(s["staleness_hist"])
        waits: dict[int, float] = {}
        for s in shards:
            for r, w in s["wait_s"].items():
                waits[r] = waits.get(r, 0.0) + w
        n = sum(hist.values())
        out: dict[str, Any] = {
            "mode": self.mode,
            "shards": len(shards),
            "staleness_bound": self.staleness if self.mode == "ssp" else None,
            "staleness_lr": self.cfg.staleness_lr,
            "pushes": sum(s["pushes"] for s in shards),
            "version": min((s["version"] for s in shards), default=0),
            "applied_pushes": min((s["applied"] for s in shards), default=0),
            "duplicates": sum(s["duplicates"] for s in shards),
            "reconnects": sum(s["reconnects"] for s in shards),
            "rejected": sum(s["rejected"] for s in shards),
            "pulls": sum(s["pulls"] for s in shards),
            "unchanged_pulls": sum(s["unchanged_pulls"] for s in shards),
            "bytes_in": sum(s["bytes_in"] for s in shards),
            "bytes_out": sum(s["bytes_out"] for s in shards),
            "raw_bytes_out": sum(s["raw_bytes_out"] for s in shards),
            "compression": self.cfg.compression,
            "push": _direction(shards, "push", "bytes_in"),
            "pull": _direction(shards, "pull", "bytes_out"),
            "staleness_hist": {
                str(k) if k < STALENESS_BINS else f"{k}+": v for k, v in sorted(hist.items())
            },
            "mean_staleness": sum(k * v for k, v in hist.items()) / n if n else 0.0,
            "max_staleness": max(hist, default=0),
            "max_ssp_gap": max((s["max_ssp_gap"] for s in shards), default=0),
            "wait_s_per_rank": [waits.get(r, 0.0) for r in range(self.world_size)],
            "failure": None
            if self._failure is None
            else {"rank": self._failure[0], "detail": self._failure[1]},
            "per_shard": [
                {k: v for k, v in s.items() if k not in ("wait_s", "staleness_hist")}
                | {"wait_s": sum(s["wait_s"].values())}
                for s in shards
            ],
        }
        out["wait_s_total"] = sum(out["wait_s_per_rank"])
        return out

    def finish(self, result: TrainResult) -> None:
        """Make ``result`` describe the server's model.

        Loads the server's parameters (the authoritative ones: in async mode rank 0's copy
        may lag the last pushes of others) into ``result.model``, adds ``summary["ps"]``
        (:meth:`stats`), and adds the server's sent bytes to ``bytes_sent``/``wire_bytes``:
        workers count what they push, the server what it sends back, so the totals cover
        both directions, as the ring's cover every rank's sends.
        """
        params = trainable(result.model)
        flat = self.parameters()
        if sum(p.numel() for p in params) != flat.size:
            raise ConfigError(
                f"the result's model has {sum(p.numel() for p in params)} trainable elements, "
                f"the parameter server {flat.size}: not the model the server was started with"
            )
        unflatten(flat, params)
        stats = self.stats()
        summary = result.summary
        summary["ps"] = stats
        # no step applied twice: the version counts applications, applied_pushes the
        # distinct step numbers (sync) or pushes (async/ssp) in the ledger
        summary["ps_version"] = stats["version"]
        summary["ps_applied_pushes"] = stats["applied_pushes"]
        summary["bytes_sent"] = summary.get("bytes_sent", 0) + stats["raw_bytes_out"]
        summary["wire_bytes"] = summary.get("wire_bytes", 0) + stats["bytes_out"]
        if summary["wire_bytes"]:
            summary["compression_ratio"] = summary["bytes_sent"] / summary["wire_bytes"]


def _clone(value: Any) -> Any:
    """A deep copy of an optimizer state dict's tensors (the live ones keep changing)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clone(v) for v in value]
    return value


def _direction(shards: list[dict[str, Any]], name: str, wire_key: str) -> dict[str, Any]:
    """One direction's byte figures: ``raw_bytes`` (the uncompressed payloads),
    ``wire_bytes`` (every byte that direction's connections carried: payload frames,
    headers, requests, handshakes), ``payload_bytes`` (the payload frames alone) and
    ``ratio = raw / wire`` (below 1 without compression: headers cost something)."""
    raw = sum(s[f"{name}_raw_bytes"] for s in shards)
    wire = sum(s[wire_key] for s in shards)
    payload = sum(s[f"{name}_payload_bytes"] for s in shards)
    return {
        "raw_bytes": raw,
        "wire_bytes": wire,
        "payload_bytes": payload,
        "ratio": raw / wire if wire else 1.0,
        "payload_ratio": raw / payload if payload else 1.0,
    }


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
    :data:`~sparktrain.ps.protocol.CHUNK_BYTES_DEFAULT`, at most the cap) sizes the
    chunks payloads travel in (tests inject tiny ones).
    """
    params = trainable(model)
    dtype = flat_dtype(params)
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
    )
