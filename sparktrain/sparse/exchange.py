"""The ring's and the tree's row path: embedding tables built with ``sparse=True``
exchange the rows a step touched, not the whole table (docs/sparse.md).

One exchange per step, after the dense buckets, on every rank in the same order:

1. a tiny allreduce of ``[n_r, k_r(table 0), k_r(table 1), ...]``: the step's total
   samples N (the dense buckets' count slot carries the same number) and, per table,
   how many rows the ranks touched in all, an upper bound of their union;
2. per table, the same decision on every rank from those sums: when the touched rows
   exceed ``sparse_density`` of the table (or one rank's message could pass the frame
   cap) the table goes the **dense** way, else the **row** way;
3. the row way: each rank packs its coalesced ``(indices, n_r * rows)`` of every such
   table into one message, the strategy's allgather (``RingAllreduce.allgather`` /
   ``TreeAllreduce.allgather``) hands every rank every message, and the rows of each id
   are summed with ``torch.unique`` plus ``index_add_``;
4. the dense way: ``n_r * rows`` scattered into a zeroed ``[rows x dim]`` buffer with
   one more column that marks the touched rows, summed by the strategy's allreduce;
   the marked rows are the union;
5. both ways divide by N, the rule of the dense buckets (``buckets.py``), so a row's
   gradient is ``sum_r n_r g_r / N`` exactly as if the table were dense, and leave the
   parameter's ``.grad`` a coalesced sparse COO tensor of the union's rows: what torch's
   own optimizers take from a ``sparse=True`` embedding in one process.

The switch picks the wire, never the numbers: both ways give the same rows (summed in
another order). Every step is vectorised: no Python loop over rows.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from sparktrain.errors import ConfigError
from sparktrain.sparse.row_codec import (
    RowCompression,
    pack_tables,
    plain_ids_nbytes,
    unpack_tables,
)
from sparktrain.sparse.rows import rows_of, sum_rows
from sparktrain.wire.frames import SHORT_HEADER_BYTES
from sparktrain.wire.mesh import Mesh

_BUFFER_DTYPES = (torch.float32, torch.float64)


class Gather(Protocol):
    def allgather(self, blob: np.ndarray, max_bytes: int) -> list[np.ndarray]: ...


class SumAllreduce(Protocol):
    def allreduce_(self, buf: np.ndarray) -> None: ...


class SparseRowExchange:
    """Averages the row gradients of ``params`` (the ``sparse=True`` embedding weights)
    over the ranks; see the module docstring for the two ways and the switch.

    ``plain`` sums float buffers (the sync's allreduce), ``gather`` is the strategy's
    allgather of byte blobs; ``density`` is ``TrainConfig.sparse_density``; ``specs``
    the compression spec of each table (the per-layer policy's, ``"none"`` by default:
    see :mod:`sparktrain.sparse.row_codec`), ``seed`` the job's seed (compressors'
    shared random choices).
    """

    def __init__(
        self,
        params: list[tuple[str, nn.Parameter]],
        plain: SumAllreduce,
        gather: Gather,
        mesh: Mesh,
        density: float,
        specs: list[str] | None = None,
        seed: int = 0,
    ) -> None:
        for name, p in params:
            if p.dim() != 2:
                raise ValueError(f"sparse table {name!r} has shape {tuple(p.shape)}, not 2-D")
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.plain = plain
        self.gather = gather
        self.mesh = mesh
        self.density = float(density)
        specs = specs if specs is not None else ["none"] * len(params)
        if len(specs) != len(params):
            raise ValueError(f"{len(specs)} compression specs for {len(params)} sparse tables")
        self.codecs = [RowCompression(spec, t, seed, mesh.rank) for t, spec in enumerate(specs)]
        self._dense_buffers: dict[int, np.ndarray] = {}
        # figures for the summary (this rank's)
        self.exchanges = 0
        self.union_rows = 0  # summed over exchanges and tables
        self.sent_rows = 0  # this rank's rows put on the wire (row way)
        self.row_way = 0  # table-exchanges that went the row way ...
        self.dense_way = 0  # ... and the dense way
        self.raw_bytes = 0
        self.wire_bytes = 0
        # every rank's row messages as sent, and as the uncompressed format would be
        self.message_bytes = 0
        self.plain_message_bytes = 0

    # ------------------------------------------------------------------ the exchange
    def exchange(self, count: float, micro: int = 1) -> float:
        """Replace every table's gradient by the sample-weighted mean over the ranks
        (a coalesced sparse COO tensor; None when no rank touched the table) for a step
        of ``count`` samples on this rank, whose gradients hold the sum of ``micro``
        micro-batch means (weighted by ``count / micro``, as the dense buckets are).
        Returns the step's total samples N."""
        weight = count / micro if micro > 1 else count
        before = self.mesh.stats.as_dict()
        local = [self._local_rows(p) for p in self.params]
        head = np.array([float(count)] + [float(i.numel()) for i, _ in local], dtype=np.float64)
        self.plain.allreduce_(head)
        total = float(head[0])
        touched = head[1:]
        row_way: list[int] = []
        dense_way: list[int] = []
        for t, p in enumerate(self.params):
            if touched[t] == 0:
                continue
            if touched[t] > self.density * p.shape[0] or self._too_big(t, touched[t]):
                dense_way.append(t)
            else:
                row_way.append(t)
        summed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        if row_way:
            summed.update(self._by_rows(row_way, local, weight, touched))
        for t in dense_way:
            summed[t] = self._by_dense(t, local[t], weight)
        for codec in self.codecs:
            codec.step_done()
        if total <= 0 and summed:
            raise RuntimeError("rows were touched but no rank contributed samples to this step")
        with torch.no_grad():
            for t, p in enumerate(self.params):
                if t not in summed:
                    p.grad = None
                    continue
                union, rows = summed[t]
                rows = rows.div_(total)
                # built from sorted unique ids inside the table: valid by construction
                p.grad = torch.sparse_coo_tensor(
                    union.unsqueeze(0),
                    rows,
                    tuple(p.shape),
                    is_coalesced=True,
                    check_invariants=False,
                ).to(p.device)
                self.union_rows += int(union.numel())
        after = self.mesh.stats.as_dict()
        self.exchanges += 1
        self.row_way += len(row_way)
        self.dense_way += len(dense_way)
        self.wire_bytes += after["wire_bytes_sent"] - before["wire_bytes_sent"]
        return total

    def _local_rows(self, p: nn.Parameter) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's coalesced rows of ``p``'s gradient (none without a gradient)."""
        g = p.grad
        if g is None:
            return torch.zeros(0, dtype=torch.int64), torch.zeros((0, p.shape[1]), dtype=p.dtype)
        if g.is_sparse:
            idx, rows = rows_of(g)
            return idx.cpu(), rows.detach().cpu()
        # a dense gradient on a sparse table (set by user code): its nonzero rows
        nz = torch.nonzero(g.detach().ne(0).any(dim=1)).reshape(-1)
        return nz.cpu(), g.detach()[nz].cpu()

    def _too_big(self, t: int, touched: float) -> bool:
        """Could one rank's message for table ``t`` alone pass the mesh's frame cap?"""
        p = self.params[t]
        return 16 + touched * (8 + p.shape[1] * p.element_size()) > self.mesh.max_frame_bytes

    def _by_rows(
        self,
        tables: list[int],
        local: list[tuple[torch.Tensor, torch.Tensor]],
        weight: float,
        touched: np.ndarray,
    ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """The row way for ``tables``: one allgather of every rank's rows times its
        ``weight``."""
        parts = [self.codecs[t].encode(local[t][0], local[t][1] * weight, weight) for t in tables]
        blob = pack_tables(weight, parts)
        # no rank's message can be longer than every touched row of these tables in
        # the widest encoding (raw, or a compressor's payload: at most the float32
        # block twice over, as topk's ids plus values) plus the headers
        limit = 8 + sum(
            1024
            + int(touched[t])
            * (8 + 2 * self.params[t].shape[1] * max(4, self.params[t].element_size()))
            for t in tables
        )
        before = self.mesh.stats.as_dict()
        blobs = self.gather.allgather(blob, limit)
        after = self.mesh.stats.as_dict()
        # the row messages travel as payload frames, which the mesh does not count as raw
        # bytes: count their payload (what went out, less the frame headers: 1-D blobs,
        # so the short form, wire/frames.py) here
        payload = (after["wire_bytes_sent"] - before["wire_bytes_sent"]) - SHORT_HEADER_BYTES * (
            after["frames_sent"] - before["frames_sent"]
        )
        self.mesh.stats.add_sent(0, raw=max(0, payload))
        self.raw_bytes += max(0, payload)
        self.sent_rows += sum(int(local[t][0].numel()) for t in tables)
        decoded = []
        for b in blobs:
            _, blob_parts = unpack_tables(b, len(tables))
            rows_parts = []
            for j, t in enumerate(tables):
                p = self.params[t]
                num_rows, dim = int(p.shape[0]), int(p.shape[1])
                ids, rows = self.codecs[t].decode(blob_parts[j], num_rows, dim, p.dtype)
                rows_parts.append((ids, rows))
                self.plain_message_bytes += plain_ids_nbytes(ids.numel()) + (
                    ids.numel() * dim * p.element_size()
                )
            self.message_bytes += int(b.size)
            self.plain_message_bytes += 8
            decoded.append(rows_parts)
        return {t: sum_rows([parts[j] for parts in decoded]) for j, t in enumerate(tables)}

    def _by_dense(
        self, t: int, local: tuple[torch.Tensor, torch.Tensor], weight: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The dense way for table ``t``: a ``[rows x (dim + 1)]`` allreduce whose last
        column counts the ranks that touched each row."""
        p = self.params[t]
        num_rows, dim = int(p.shape[0]), int(p.shape[1])
        dtype = p.dtype if p.dtype in _BUFFER_DTYPES else torch.float32
        flat = self._dense_buffers.get(t)
        if flat is None:  # kept: a fresh table-sized buffer per step costs page faults
            flat = np.zeros(num_rows * (dim + 1), dtype=torch.empty((), dtype=dtype).numpy().dtype)
            self._dense_buffers[t] = flat
        buf = torch.from_numpy(flat)
        buf.zero_()
        values = buf[: num_rows * dim].view(num_rows, dim)
        marks = buf[num_rows * dim :]
        # exact: every carried residual row of the table goes too (and is cleared)
        idx, rows = self.codecs[t].take_all(local[0], local[1] * weight, weight)
        if idx.numel():
            values.index_copy_(0, idx, rows.to(dtype))
            marks[idx] = 1
        before = self.mesh.stats.as_dict()
        self.plain.allreduce_(flat)
        after = self.mesh.stats.as_dict()
        self.raw_bytes += after["raw_bytes_sent"] - before["raw_bytes_sent"]
        union = torch.nonzero(marks).reshape(-1)
        return union, values[union].to(p.dtype)

    def stats(self) -> dict[str, Any]:
        """This rank's figures of the row path (docs/summary.md)."""
        steps = max(1, self.exchanges)
        return {
            "sparse_tables": len(self.params),
            "sparse_exchanges": self.exchanges,
            "sparse_rows_per_step": self.union_rows / steps,
            "sparse_rows_sent": self.sent_rows,
            "sparse_row_way": self.row_way,
            "sparse_dense_way": self.dense_way,
            "sparse_raw_bytes_sent": self.raw_bytes,
            "sparse_wire_bytes_sent": self.wire_bytes,
            # every rank's row messages as this rank received them (the same on all):
            # their bytes and what the uncompressed format would have taken
            "sparse_message_bytes": self.message_bytes,
            "sparse_plain_message_bytes": self.plain_message_bytes,
            "sparse_compression": {
                self.names[t]: c.spec for t, c in enumerate(self.codecs) if c.compressed
            },
        }

    def state_dict(self) -> dict[str, Any]:
        """This rank's row compressors' state (residual rows, generators, steps) per
        table name, for the rank's checkpoint shard; empty without compressed tables."""
        return {self.names[t]: c.state_dict() for t, c in enumerate(self.codecs) if c.compressed}

    def load_state_dict(self, data: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s output of the same rank."""
        mine = {self.names[t]: c for t, c in enumerate(self.codecs) if c.compressed}
        if not data:
            # a checkpoint from before the rows were compressed (they went raw, so no
            # error was carried): the row compressors start fresh, losing nothing
            return
        if set(data) != set(mine):
            raise ConfigError(
                f"the checkpoint holds row compressor state for tables {sorted(data)}, this "
                f"run compresses the rows of {sorted(mine)}: resume with the same compression"
            )
        for name, codec in mine.items():
            codec.load_state_dict(data[name])
