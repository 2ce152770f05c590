"""Block tables kept on the device between steps and updated by what changed, not rebuilt every step.

Each sequence owns a row of one [rows, width] int32 table; a step's `block_tables` is a gather of its
spans' rows, cut to the longest table of the step and padded with block 0 (as build_metadata's).
Between two steps a sequence's table normally only grows at its tail (BlockManager.append), so only
the new entries are written. Any other change (a first allocation, a truncation of rejected drafts,
a free after preemption) bumps the sequence's `block_table_version`, which the span carries: a row
whose version differs is rewritten whole. A span without a version (-1) is always rewritten whole.

Every entry is range-checked against `num_blocks` (when given) as it is written into the mirror, so each block
id is checked once, when it first reaches the device, instead of every step (`validate_spans` walks every
table only in debug mode). `rows_used` keeps the last gather's row of each span: `slots` reads a decode step's
slots from the mirror through it (engine/attention/metadata.py, engine/cuda_graphs.py), not from the spans' lists.

On CUDA the host mirror and the staging buffer are pinned: per step one host-to-device copy carries
the step's row indices and the changed entries, and the device scatters and gathers. A row of a
sequence absent from a step stays until its row is needed (least recently used first); the table
doubles its rows or width when a step needs more.
"""
from __future__ import annotations

import numpy as np
import torch

from engine.batch import SeqSpan


class BlockTables:
    def __init__(self, device: torch.device, rows: int = 64, width: int = 16, num_blocks: int | None = None) -> None:
        self.device = device
        self.num_blocks = num_blocks            # block ids must lie in [0, num_blocks) (None: not checked)
        self.rows_used = np.zeros(0, dtype=np.intp)     # the last gather's row of each span
        self.pinned = device.type == "cuda"
        self.rows: dict[int, list[int]] = {}     # seq_id -> [row, version, known length, last step used]
        self.free_rows: list[int] = []
        self.step = 0
        self._stage_done: torch.cuda.Event | None = None
        self._allocate(rows, width)
        self._stage_host = self._stage_dev = torch.zeros(0, dtype=torch.int64)

    def _allocate(self, rows: int, width: int) -> None:
        old = getattr(self, "mirror", None)
        self.mirror = torch.zeros(rows, width, dtype=torch.int32, pin_memory=self.pinned)
        self.mirror_np = self.mirror.numpy()
        if old is not None:
            self.mirror_np[:old.shape[0], :old.shape[1]] = old.numpy()
            self.free_rows += range(old.shape[0], rows)
        else:
            self.free_rows = list(range(rows - 1, -1, -1))
        self.table = self.mirror.to(self.device) if self.pinned else self.mirror

    def gather(self, spans: list[SeqSpan]) -> torch.Tensor:
        """[len(spans), longest table] int32 on the device: each span's block table, padded with 0."""
        self.step += 1
        width = max(len(span.block_table) for span in spans)
        if width > self.mirror.shape[1]:
            self._grow(self.mirror.shape[0], max(width, 2 * self.mirror.shape[1]))
        if len(spans) > self.mirror.shape[0]:
            self._grow(max(len(spans), 2 * self.mirror.shape[0]), self.mirror.shape[1])
        order: list[int] = []
        changed: list[tuple[int, int, int]] = []       # (row, first column, last column + 1) written
        get, step, append = self.rows.get, self.step, order.append
        for span in spans:
            entry = get(span.seq_id)
            # unchanged since the last step (most decodes): only the row's last use is noted
            if entry is not None and entry[2] == len(span.block_table) and entry[1] == span.table_version >= 0:
                entry[3] = step
                append(entry[0])
            else:
                append(self._update(span, changed))
        self.rows_used = rows = np.array(order, dtype=np.intp)
        if not self.pinned:     # rows of a column slice by an index array: ~2x cheaper than [list, :width]
            return torch.from_numpy(self.mirror_np[:, :width][rows])
        return self._upload(order, changed, width)

    def slots(self, positions: np.ndarray, block_size: int) -> np.ndarray:
        """int64 cache slots of one token per span of the last `gather`, at `positions` (one per span), read from the
        kept rows (ids range-checked as they were written) instead of the spans' lists."""
        blocks = self.mirror_np[self.rows_used, positions // block_size].astype(np.int64)
        return blocks * block_size + positions % block_size

    def _update(self, span: SeqSpan, changed: list[tuple[int, int, int]]) -> int:
        table, version = span.block_table, span.table_version
        entry = self.rows.get(span.seq_id)
        if entry is None:
            entry = self.rows[span.seq_id] = [self._take_row(), -2, 0, 0]
        row, known = entry[0], entry[2]
        entry[3] = self.step
        if version == entry[1] and version >= 0 and len(table) >= known:
            start = known                                   # grew at its tail only
        else:
            start = 0
            if known > len(table):
                self.mirror_np[row, len(table):known] = 0
                changed.append((row, len(table), known))
        if start < len(table):
            new = table[start:]     # min/max of a short list: ~10x cheaper than numpy's on the written slice
            bad = self.num_blocks is not None and (min(new) < 0 or max(new) >= self.num_blocks)
            if not bad:
                try:
                    self.mirror_np[row, start:len(table)] = new
                except OverflowError:   # not even an int32 (no num_blocks to check against)
                    bad = True
            if bad:
                entry[1], entry[2] = -2, max(known, len(table))    # rewritten whole next time
                bounds = "" if self.num_blocks is None else f" [0, {self.num_blocks})"
                raise ValueError(f"sequence {span.seq_id}: block id out of range{bounds}")
            changed.append((row, start, len(table)))
        entry[1], entry[2] = version, len(table)
        return row

    def _take_row(self) -> int:
        if not self.free_rows:
            stale = [(entry[3], seq_id) for seq_id, entry in self.rows.items() if entry[3] < self.step]
            if not stale:
                self._grow(2 * self.mirror.shape[0], self.mirror.shape[1])
            else:
                seq_id = min(stale)[1]
                row, _, known, _ = self.rows.pop(seq_id)
                self.mirror_np[row, :known] = 0
                if self.pinned:
                    self.table[row, :known] = 0
                self.free_rows.append(row)
        return self.free_rows.pop()

    def _grow(self, rows: int, width: int) -> None:
        if self.pinned:
            self._sync_stage()
        self._allocate(rows, width)

    def _sync_stage(self) -> None:
        if self._stage_done is not None:
            self._stage_done.synchronize()   # the previous copy has left the pinned buffer

    def _upload(self, order: list[int], changed: list[tuple[int, int, int]], width: int) -> torch.Tensor:
        cols = self.mirror.shape[1]
        flat: list[int] = []
        for row, start, end in changed:
            flat += range(row * cols + start, row * cols + end)
        size = len(order) + 2 * len(flat)
        if size > self._stage_host.numel():
            self._sync_stage()
            self._stage_host = torch.zeros(max(size, 2 * self._stage_host.numel(), 1024), dtype=torch.int64,
                                           pin_memory=True)
            self._stage_dev = torch.empty_like(self._stage_host, device=self.device)
        self._sync_stage()
        stage = self._stage_host.numpy()
        stage[:len(order)] = order
        if flat:
            index = np.asarray(flat, dtype=np.int64)
            stage[len(order):len(order) + len(flat)] = index
            stage[len(order) + len(flat):size] = self.mirror_np.reshape(-1)[index]
        self._stage_dev[:size].copy_(self._stage_host[:size], non_blocking=True)
        self._stage_done = torch.cuda.Event()
        self._stage_done.record(torch.cuda.current_stream(self.device))   # the stream the copy above ran on
        if flat:
            device_flat = self._stage_dev[len(order):len(order) + len(flat)]
            self.table.view(-1)[device_flat] = self._stage_dev[len(order) + len(flat):size].to(torch.int32)
        return self.table[:, :width].index_select(0, self._stage_dev[:len(order)])
