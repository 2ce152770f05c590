"""HeadDrafter: drafts from the target's own hidden states (Medusa heads, EAGLE-3), for every drafted decode
row of a step in one call on rank 0, between the scheduler's reservation and the verification forward."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.spec_decode.batch_drafter import SlotDrafter

if TYPE_CHECKING:
    from engine.sequence import Sequence


@dataclass(slots=True)
class DraftRow:
    """A drafted decode row: `token_ids[num_computed]` (the last token) is the one the verification forward
    computes first; `num_drafts` tokens after it are wanted."""
    seq_id: int
    token_ids: list[int]
    num_computed: int
    block_table: list[int]
    num_drafts: int


class HeadDrafter(SlotDrafter):
    def __init__(self, draft: Callable[[list[DraftRow]], list[list[int]]], max_drafts: int,
                 wants: Callable[[Sequence, int], int] | None = None):
        super().__init__(wants, max_drafts)  # Medusa: at most its number of heads
        self.draft = draft            # rows -> each row's draft tokens (rank 0's heads)

    def _draft(self, seqs: list[Sequence]) -> list[list[int]]:
        return self.draft([DraftRow(seq.seq_id, seq.token_ids, seq.num_computed_tokens, seq.block_table,
                                    len(seq.draft_token_ids)) for seq in seqs])
