"""Token counts for the repetition and frequency penalties, kept between steps on the logits' device.

Each penalised sequence owns a row of [rows, vocab] tables: which ids its prompt + generated tokens hold
(repetition penalty) and how often each id was generated (frequency penalty). A step adds only the
tokens appended since the sequence's last step (one per decode), instead of turning its whole history
into tensors. A row is rebuilt from the history when the sequence is new to the table, when its history
got shorter than what was counted, or when its row was given to another sequence meanwhile (least
recently used first, when the table is full). Rows without a `seq_id` (the verifier's draft positions)
are counted from their history each time. One instance per engine: sequence ids are its own.
Under async scheduling the first rows of a step ahead have a token in flight: picked on the device by the step
before, not yet in their histories. `in_flight` (those tokens, still on the device) adds each to its row of
the step's counts, not to the tables, so the pick needs nothing from the host; the tables count the token from
the history once it is appended.
On CPU the sampler reads the histories themselves instead, kept as arrays between steps by `histories`.
"""
from __future__ import annotations

from array import array
from typing import Sequence

import torch

from engine.device_copy import list_to_device, to_device
from engine.token_histories import TokenHistories


class PenaltyCounts:
    def __init__(self, rows: int = 16) -> None:
        self.capacity = rows
        self.slots: dict[tuple[str, int], list[int]] = {}   # (kind, seq_id) -> [row, counted tokens, last call]
        self.tables: dict[str, torch.Tensor] = {}
        self.free: dict[str, list[int]] = {}
        self.calls = 0
        self.histories = TokenHistories()    # the CPU path's (engine/token_histories.py)

    def presence(self, rows: Sequence, which: list[int], vocab: int, device: torch.device,
                 in_flight: torch.Tensor | None = None) -> torch.Tensor:
        """[len(which), vocab] bool: the ids in each row's prompt + generated tokens (+ its token in flight:
        `in_flight[r]` for rows r < len(in_flight))."""
        return self._with_in_flight(self._gather("presence", rows, which, vocab, device), which, in_flight) > 0

    def generated(self, rows: Sequence, which: list[int], vocab: int, device: torch.device,
                  in_flight: torch.Tensor | None = None) -> torch.Tensor:
        """[len(which), vocab] int32: how often each id was generated (the prompt not counted; the token in flight
        counted, as for `presence`)."""
        return self._with_in_flight(self._gather("generated", rows, which, vocab, device), which, in_flight)

    @staticmethod
    def _with_in_flight(picked: torch.Tensor, which: list[int], in_flight: torch.Tensor | None) -> torch.Tensor:
        """`picked` (a copy of the tables' rows) with each row's token in flight added, on the device."""
        if in_flight is None:
            return picked
        flying = [(j, r) for j, r in enumerate(which) if r < len(in_flight)]
        if flying:
            device = picked.device
            tokens = in_flight.index_select(0, list_to_device([r for _, r in flying], torch.int64, device))
            picked.index_put_((list_to_device([j for j, _ in flying], torch.int64, device), tokens),
                              torch.ones((), dtype=picked.dtype, device=device), accumulate=True)
        return picked

    def _gather(self, kind: str, rows: Sequence, which: list[int], vocab: int, device: torch.device) -> torch.Tensor:
        self.calls += 1
        self._table(kind, vocab, device, len(which))
        order: list[int] = []
        one_off: list[int] = []
        slot_ids, token_ids = array("q"), array("q")
        for r in which:
            row = rows[r]
            history = row.token_ids[row.num_prompt_tokens:] if kind == "generated" else row.token_ids
            seq_id = getattr(row, "seq_id", None)
            entry = self.slots.get((kind, seq_id)) if seq_id is not None else None
            if entry is None or len(history) < entry[1]:
                entry = self._claim(kind, seq_id, entry)
                self.tables[kind][entry[0]].zero_()
                if seq_id is None:
                    one_off.append(entry[0])
            new = history[entry[1]:]
            slot_ids.extend([entry[0]] * len(new))
            token_ids.extend(new)
            entry[1], entry[2] = len(history), self.calls
            order.append(entry[0])
        table = self.tables[kind]
        if token_ids:
            index = (to_device(torch.frombuffer(slot_ids, dtype=torch.int64), device),
                     to_device(torch.frombuffer(token_ids, dtype=torch.int64), device))
            table.index_put_(index, torch.ones((), dtype=table.dtype, device=device), accumulate=True)
        picked = table[list_to_device(order, torch.int64, device)]     # a copy: the in-flight add leaves the table
        self.free[kind] += one_off            # rows counted from their history alone go back at once
        return picked

    def _table(self, kind: str, vocab: int, device: torch.device, needed: int) -> None:
        table = self.tables.get(kind)
        if table is None or table.shape[1] != vocab or table.device != device:
            self.tables[kind] = torch.zeros(max(self.capacity, needed), vocab, dtype=torch.int32, device=device)
            self.free[kind] = list(range(self.tables[kind].shape[0] - 1, -1, -1))
            self.slots = {k: e for k, e in self.slots.items() if k[0] != kind}

    def _claim(self, kind: str, seq_id: int | None, entry: list[int] | None) -> list[int]:
        """A row for `seq_id` (registered) or for a row without one (not registered: freed after the call)."""
        if entry is not None:                  # a shorter history: recount in the same row
            entry[1] = 0
            return entry
        if not self.free[kind]:
            stale = [(e[2], k) for k, e in self.slots.items() if k[0] == kind and e[2] < self.calls]
            if stale:
                self.free[kind].append(self.slots.pop(min(stale)[1])[0])
            else:                              # every row is in this call: double the table
                table = self.tables[kind]
                grown = torch.zeros(2 * table.shape[0], table.shape[1], dtype=table.dtype, device=table.device)
                grown[:table.shape[0]] = table
                self.free[kind] = list(range(grown.shape[0] - 1, table.shape[0] - 1, -1))
                self.tables[kind] = grown
        entry = [self.free[kind].pop(), 0, self.calls]
        if seq_id is not None:
            self.slots[(kind, seq_id)] = entry
        return entry
