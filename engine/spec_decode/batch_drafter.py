"""BatchDrafter: draft tokens for every drafted decode row of a step with k batched forwards of a draft model."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from engine.batch import SeqSpan

if TYPE_CHECKING:
    from engine.scheduler import ScheduledBatch
    from engine.sequence import Sequence

# spans of one token each -> their logits [len(spans), vocab]
DraftForward = Callable[[list[SeqSpan]], torch.Tensor]
PLACEHOLDER = 0     # a draft slot the scheduler reserved and `fill` has not written yet


class SlotDrafter:
    """Drafting in two phases, so the scheduler keeps one per-row `propose(seq, room)` hook: `propose`
    claims up to `room` draft slots (at most `max_drafts`, fewer when `wants` says so; the scheduler
    reserves their KV blocks), then `fill` drafts every claimed row of the step at once (`_draft`) and
    writes the tokens into each row's drafts and span. A deterministic draft keeps the verifier exact:
    rejection sampling accepts x with p(x), whatever chose x."""

    def __init__(self, wants: Callable[[Sequence, int], int] | None = None, max_drafts: int | None = None):
        self.wants = wants            # (seq, room) -> how many slots to claim; None = all of them
        self.max_drafts = max_drafts  # None = as many as the scheduler has room for

    def propose(self, seq: Sequence, room: int) -> list[int]:
        if self.max_drafts is not None:
            room = min(room, self.max_drafts)
        num = room if self.wants is None else min(room, self.wants(seq, room))
        return [PLACEHOLDER] * max(num, 0)

    def fill(self, batch: ScheduledBatch) -> None:
        rows = [(seq, span) for seq, span in zip(batch.seqs, batch.spans) if seq.draft_token_ids]
        if not rows:
            return
        for (seq, span), draft in zip(rows, self._draft([seq for seq, _ in rows])):
            seq.draft_token_ids[:] = draft
            span.token_ids[len(span.token_ids) - len(draft):] = draft

    def _draft(self, seqs: list[Sequence]) -> list[list[int]]:
        """Each sequence's draft tokens, as many as its claimed slots (len(seq.draft_token_ids))."""
        raise NotImplementedError


class BatchDrafter(SlotDrafter):
    """Model drafting: the draft forwards run over all claimed rows together (step j: row i's j-th token at
    its position), taking the argmax tokens.

    The draft writes K/V into the rows' own block tables past `num_computed_tokens`, slots the
    verification forward rewrites (layer skip: the same layers, the same values) and the rollback frees.
    """

    def __init__(self, forward: DraftForward, wants: Callable[[Sequence, int], int] | None = None):
        super().__init__(wants)
        self.forward = forward

    def _draft(self, seqs: list[Sequence]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in seqs]
        for j in range(max(len(seq.draft_token_ids) for seq in seqs)):
            active = [i for i, seq in enumerate(seqs) if len(seq.draft_token_ids) > j]
            spans = []
            for i in active:
                seq = seqs[i]
                token = drafts[i][-1] if j else seq.token_ids[-1]
                spans.append(SeqSpan(seq.seq_id, [token], seq.num_computed_tokens + j, seq.block_table, "last",
                                     seq.adapter))
            best = self.forward(spans).argmax(dim=-1).tolist()
            for i, token in zip(active, best):
                drafts[i].append(token)
        return drafts
