"""Token histories (prompt + generated ids) kept as int64 arrays between steps, for the penalties on CPU.

A penalised row is read whole every step (its ids index the scores), and turning a 2k-token list into an
array costs ~20 us (10 ns a token) while a decode adds one token. Each sequence (by `seq_id`) keeps a growing
buffer: a step copies in only the ids appended since its last one. The buffer is rebuilt when the sequence's
list is another object or shorter than what was kept (a rollback); rows without a `seq_id` (the verifier's
draft positions) are converted each time. Sequences not seen for IDLE_CALLS calls are dropped.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from engine.device_copy import to_device

IDLE_CALLS = 64


class TokenHistories:
    def __init__(self) -> None:
        self.kept: dict[int, list[Any]] = {}    # seq_id -> [buffer (int64), length kept, token list, last call]
        self.calls = 0

    def padded(self, rows: Sequence, which: list[int], generated_only: bool,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """[len(which), max_len] token ids per row (all of them, or the generated ones only), padded with that
        row's first id, and a 0/1 float mask of the real ones."""
        self.calls += 1
        views = [self._history(rows[r]) for r in which]
        if generated_only:
            views = [view[rows[r].num_prompt_tokens:] for r, view in zip(which, views)]
        lengths = np.fromiter((len(view) for view in views), np.int64, len(views))
        width = max(1, int(lengths.max(initial=0)))
        ids = np.zeros((len(views), width), dtype=np.int64)
        for j, view in enumerate(views):
            if len(view):
                ids[j, :len(view)] = view
                ids[j, len(view):] = view[0]
        mask = (np.arange(width) < lengths[:, None]).astype(np.float32)
        if len(self.kept) > 2 * len(which) + IDLE_CALLS:
            self.kept = {k: e for k, e in self.kept.items() if e[3] >= self.calls - IDLE_CALLS}
        return to_device(torch.from_numpy(ids), device), to_device(torch.from_numpy(mask), device)

    def _history(self, row: Any) -> np.ndarray:
        token_ids = row.token_ids
        seq_id = getattr(row, "seq_id", None)
        if seq_id is None:
            return np.array(token_ids, dtype=np.int64)
        entry = self.kept.get(seq_id)
        if entry is None or entry[2] is not token_ids or len(token_ids) < entry[1]:
            buffer = np.empty(max(16, 2 * len(token_ids)), dtype=np.int64)
            buffer[:len(token_ids)] = token_ids
            entry = self.kept[seq_id] = [buffer, len(token_ids), token_ids, self.calls]
        elif len(token_ids) > entry[1]:
            buffer, known = entry[0], entry[1]
            if len(token_ids) > len(buffer):
                grown = np.empty(2 * len(token_ids), dtype=np.int64)
                grown[:known] = buffer[:known]
                buffer = entry[0] = grown
            buffer[known:len(token_ids)] = token_ids[known:]
            entry[1] = len(token_ids)
        entry[3] = self.calls
        return entry[0][:entry[1]]
