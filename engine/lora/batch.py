"""LoraBatch: which adapter each token of the current step uses, shared by every adapted layer."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from engine.batch import SeqSpan


class LoraBatch:
    """Set from the step's spans before the forward, cleared after it (warm-up and decode graphs see no adapter).

    `token_indices` [T] int32 holds each token's adapter index (0 = base); `groups` lists, per adapter
    present, its stack row and its token rows (a slice when they are contiguous) for the grouped path.

    Piecewise graphs (engine/piecewise_graphs.py) capture the adapted layers over a static map instead:
    `stage` copies the step's map into `graph_indices` (padding rows 0), and inside `graphed(n)` every adapted
    layer reads its first n entries through a path with no data-dependent Python (engine/lora/backend.py).
    """

    def __init__(self) -> None:
        self.num_tokens = 0
        self.token_indices: torch.Tensor | None = None
        self.groups: list[tuple[int, slice | torch.Tensor]] = []
        self.graph_indices: torch.Tensor | None = None
        self.in_graph = False

    @property
    def active(self) -> bool:
        return self.in_graph or bool(self.groups)

    def allocate_graph_map(self, max_tokens: int, device: torch.device) -> None:
        self.graph_indices = torch.zeros(max_tokens, dtype=torch.int32, device=device)

    def stage(self, num_tokens: int, padded: int) -> None:
        """The step's map (set by `set`) into the static one, padding rows on the base model."""
        if self.token_indices is None:
            self.graph_indices[:padded].zero_()
            return
        self.graph_indices[:num_tokens].copy_(self.token_indices)
        self.graph_indices[num_tokens:padded].zero_()

    @contextmanager
    def graphed(self, padded: int) -> Iterator[None]:
        saved = self.num_tokens, self.token_indices, self.in_graph
        self.num_tokens, self.token_indices, self.in_graph = padded, self.graph_indices[:padded], True
        try:
            yield
        finally:
            self.num_tokens, self.token_indices, self.in_graph = saved

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
