"""HeadDrafter: drafts from the target's own hidden states (Medusa heads, EAGLE-3), for every drafted decode
row of a step in one call on rank 0, between the scheduler's reservation and the verification forward."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.spec_decode.batch_drafter import PLACEHOLDER

if TYPE_CHECKING:
    from engine.scheduler import ScheduledBatch
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


class HeadDrafter:
    def __init__(self, draft: Callable[[list[DraftRow]], list[list[int]]], max_drafts: int,
                 wants: Callable[[Sequence, int], int] | None = None):
        self.draft = draft            # rows -> each row's draft tokens (rank 0's heads)
        self.max_drafts = max_drafts  # Medusa: its number of heads
        self.wants = wants            # --speculate auto: (seq, room) -> how many

    def propose(self, seq: Sequence, room: int) -> list[int]:
        room = min(room, self.max_drafts)
        num = room if self.wants is None else min(room, self.wants(seq, room))
        return [PLACEHOLDER] * max(num, 0)

    def fill(self, batch: ScheduledBatch) -> None:
        rows = [(seq, span) for seq, span in zip(batch.seqs, batch.spans) if seq.draft_token_ids]
        if not rows:
            return
        drafts = self.draft([DraftRow(seq.seq_id, seq.token_ids, seq.num_computed_tokens, seq.block_table,
                                      len(seq.draft_token_ids)) for seq, _ in rows])
        for (seq, span), draft in zip(rows, drafts):
            seq.draft_token_ids[:] = draft
            span.token_ids[len(span.token_ids) - len(draft):] = draft
