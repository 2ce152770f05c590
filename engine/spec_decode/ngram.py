"""NgramProposer: draft tokens by matching a sequence's last tokens against its own earlier tokens."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.sequence import Sequence

DEFAULT_MAX_NGRAM = 3


@dataclass(slots=True)
class NgramIndex:
    """For n = 1..max_n: n-gram -> the position right after its most recent occurrence that has a
    follower. Grown as tokens are appended (O(max_n) dict updates per token); tokens are never
    removed (rejected drafts never enter `token_ids`), so the index never needs a rollback."""

    max_n: int
    maps: list[dict[tuple[int, ...], int]] = field(default_factory=list)
    num_indexed: int = 0        # positions p < num_indexed have had their preceding n-grams recorded

    def __post_init__(self) -> None:
        self.maps = [{} for _ in range(self.max_n)]

    def update(self, token_ids: list[int]) -> None:
        # an n-gram ending at p - 1 is recorded once token p (its follower) exists; the last token has none yet.
        # dict.update keeps the last of equal keys, i.e. the most recent occurrence (C loops: a 4k prompt
        # indexes in milliseconds)
        length = len(token_ids)
        for n in range(1, self.max_n + 1):
            first = max(self.num_indexed, n)
            if first < length:
                grams = zip(*(token_ids[first - n + j:length - n + j] for j in range(n)))
                self.maps[n - 1].update(zip(grams, range(first, length)))
        self.num_indexed = max(self.num_indexed, length)

    def follower(self, token_ids: list[int]) -> int | None:
        """Where the tokens after the most recent earlier match of the longest matching suffix start."""
        for n in range(min(self.max_n, len(token_ids)), 0, -1):
            position = self.maps[n - 1].get(tuple(token_ids[-n:]))
            if position is not None:
                return position
        return None


class NgramProposer:
    """Proposes up to `max_tokens` tokens: what followed the most recent earlier occurrence of the
    sequence's last n tokens (n from `max_ngram` down to 1) in its prompt + output.

    The index lives on the sequence (`seq.ngram_index`), so a sequence keeps it across steps and
    preemption; only the tokens appended since the last call are indexed.
    """

    def __init__(self, max_ngram: int = DEFAULT_MAX_NGRAM):
        if max_ngram < 1:
            raise ValueError(f"max_ngram must be >= 1, got {max_ngram}")
        self.max_ngram = max_ngram

    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        if max_tokens <= 0 or not seq.token_ids:
            return []
        index = seq.ngram_index
        if index is None:
            index = seq.ngram_index = NgramIndex(self.max_ngram)
        token_ids = seq.token_ids
        index.update(token_ids)
        start = index.follower(token_ids)
        if start is None:
            return []
        return token_ids[start:start + max_tokens]
