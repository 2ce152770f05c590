"""HiddenRows: per sequence, the target's hidden states at consecutive positions, for drafters that read them
(Medusa heads read the last one, EAGLE-3 every one its own KV cache has not taken in yet).

A forward's rows at positions [p, p + n) replace whatever the store held from p on (a rolled-back draft tail,
a recompute after preemption); rows that do not follow the held ones (a prefix-cache hit, a gap) start over.
The store keeps at most `max_seqs` sequences, dropping the least recently written: a finished sequence's rows
go that way, and a sequence that finds none drafts from nothing (its drafts are then poor, never wrong).
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from engine.batch import SeqSpan


class HiddenRows:
    def __init__(self, max_seqs: int = 1024, history: bool = True):
        self.max_seqs = max_seqs
        self.history = history      # False: a forward's rows replace the sequence's rows (Medusa: the last one)
        # seq_id -> (first position, chunks of consecutive rows): appending never copies what is held
        self.rows: OrderedDict[int, tuple[int, list[torch.Tensor]]] = OrderedDict()

    def put(self, seq_id: int, start: int, rows: torch.Tensor) -> None:
        if not len(rows):
            return
        rows = rows.clone()         # not a view that keeps the whole forward's activations alive
        held = self.rows.pop(seq_id, None)
        if self.history and held is not None and held[0] < start <= held[0] + _length(held[1]):
            self.rows[seq_id] = (held[0], _cut(held[1], start - held[0]) + [rows])
        else:
            self.rows[seq_id] = (start, [rows])
        while len(self.rows) > self.max_seqs:
            self.rows.popitem(last=False)

    def get(self, seq_id: int, start: int, end: int) -> torch.Tensor | None:
        """Rows of positions [start, end), or None when the store does not hold all of them."""
        held = self.rows.get(seq_id)
        if held is None or start < held[0] or end > held[0] + _length(held[1]) or end <= start:
            return None
        chunks = _cut(held[1], end - held[0])
        first = start - held[0]
        while first >= len(chunks[0]):
            first -= len(chunks[0])
            chunks = chunks[1:]
        chunks[0] = chunks[0][first:]
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks)

    def first(self, seq_id: int) -> int | None:
        held = self.rows.get(seq_id)
        return None if held is None else held[0]

    def drop_before(self, seq_id: int, position: int) -> None:
        held = self.rows.get(seq_id)
        if held is None or position <= held[0]:
            return
        rest = self.get(seq_id, position, held[0] + _length(held[1]))
        if rest is None:
            del self.rows[seq_id]
        else:
            self.rows[seq_id] = (position, [rest.clone()])

    def put_spans(self, spans: list[SeqSpan], rows: torch.Tensor, every_token: bool = False) -> None:
        """Store a forward's rows: the logits rows of each span (last token, or all for "all"), or with
        `every_token` every token row of the forward."""
        offset = 0
        for span in spans:
            n = len(span.token_ids)
            if every_token:
                self.put(span.seq_id, span.start_pos, rows[offset:offset + n])
                offset += n
            elif span.logits == "all":
                self.put(span.seq_id, span.start_pos, rows[offset:offset + n])
                offset += n
            elif span.logits == "last":
                self.put(span.seq_id, span.start_pos + n - 1, rows[offset:offset + 1])
                offset += 1


def _length(chunks: list[torch.Tensor]) -> int:
    return sum(len(chunk) for chunk in chunks)


def _cut(chunks: list[torch.Tensor], length: int) -> list[torch.Tensor]:
    """The first `length` rows of `chunks`, as chunks."""
    kept = []
    for chunk in chunks:
        if length <= 0:
            break
        kept.append(chunk[:length])
        length -= len(chunk)
    return kept
