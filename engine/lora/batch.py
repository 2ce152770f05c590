"""LoraBatch: which adapter each token of the current step uses, shared by every adapted layer."""
from __future__ import annotations

import torch

from engine.batch import SeqSpan


class LoraBatch:
    """Set from the step's spans before the forward, cleared after it (warm-up and graphs see no adapter).

    `token_indices` [T] int32 holds each token's adapter index (0 = base); `groups` lists, per adapter
    present, its stack row and its token rows (a slice when they are contiguous) for the grouped path.
    """

    def __init__(self) -> None:
        self.num_tokens = 0
        self.token_indices: torch.Tensor | None = None
        self.groups: list[tuple[int, slice | torch.Tensor]] = []

    @property
    def active(self) -> bool:
        return bool(self.groups)

    def set(self, spans: list[SeqSpan], device: torch.device) -> None:
        indices: list[int] = []
        rows: dict[int, list[tuple[int, int]]] = {}
        for span in spans:
            start = len(indices)
            indices += [span.adapter] * len(span.token_ids)
            if span.adapter:
                rows.setdefault(span.adapter, []).append((start, len(indices)))
        self.num_tokens = len(indices)
        self.groups = [(adapter - 1, _rows(ranges, device)) for adapter, ranges in sorted(rows.items())]
        self.token_indices = torch.tensor(indices, dtype=torch.int32).to(device) if self.groups else None

    def clear(self) -> None:
        self.num_tokens, self.token_indices, self.groups = 0, None, []


def order_by_adapter(spans: list[SeqSpan]) -> tuple[list[SeqSpan], list[int] | None]:
    """The spans with each adapter's together (so its tokens are one slice), and the logits rows to take from the
    reordered run to get the original span order back (None when the order did not change)."""
    order = sorted(range(len(spans)), key=lambda i: spans[i].adapter)
    if order == list(range(len(spans))):
        return spans, None
    counts = [len(s.token_ids) if s.logits == "all" else int(s.logits == "last") for s in spans]
    first, row = [0] * len(spans), 0
    for i in order:
        first[i], row = row, row + counts[i]
    return [spans[i] for i in order], [r for i in range(len(spans)) for r in range(first[i], first[i] + counts[i])]


def _rows(ranges: list[tuple[int, int]], device: torch.device) -> slice | torch.Tensor:
    merged = [list(ranges[0])]
    for start, end in ranges[1:]:
        if start == merged[-1][1]:
            merged[-1][1] = end
        else:
            merged.append([start, end])
    if len(merged) == 1:
        return slice(*merged[0])
    return torch.cat([torch.arange(s, e) for s, e in merged]).to(device)
