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


class BatchDrafter:
    """Model drafting in two phases, so the scheduler keeps one per-row `propose(seq, room)` hook:
    `propose` claims `room` draft slots (the scheduler reserves their KV blocks), then `fill` runs the
    draft forwards over all claimed rows together (step j: row i's j-th token at its position) and writes
    the argmax tokens into each row's drafts and span. A deterministic draft keeps the verifier exact:
    rejection sampling accepts x with p(x), whatever chose x.

    The draft writes K/V into the rows' own block tables past `num_computed_tokens`, slots the
    verification forward rewrites (layer skip: the same layers, the same values) and the rollback frees.
    """

    def __init__(self, forward: DraftForward, wants: Callable[[Sequence, int], int] | None = None):
        self.forward = forward
        self.wants = wants      # (seq, room) -> how many slots to claim; None = all of them

    def propose(self, seq: Sequence, room: int) -> list[int]:
        num = room if self.wants is None else min(room, self.wants(seq, room))
        return [PLACEHOLDER] * max(num, 0)

    def fill(self, batch: ScheduledBatch) -> None:
        rows = [(seq, span) for seq, span in zip(batch.seqs, batch.spans) if seq.draft_token_ids]
        if not rows:
            return
        drafts: list[list[int]] = [[] for _ in rows]
        for j in range(max(len(seq.draft_token_ids) for seq, _ in rows)):
            active = [i for i, (seq, _) in enumerate(rows) if len(seq.draft_token_ids) > j]
            spans = []
            for i in active:
                seq, _ = rows[i]
                token = drafts[i][-1] if j else seq.token_ids[-1]
                spans.append(SeqSpan(seq.seq_id, [token], seq.num_computed_tokens + j, seq.block_table, "last",
                                     seq.adapter))
            best = self.forward(spans).argmax(dim=-1).tolist()
            for i, token in zip(active, best):
                drafts[i].append(token)
        for (seq, span), draft in zip(rows, drafts):
            seq.draft_token_ids[:] = draft
            span.token_ids[len(span.token_ids) - len(draft):] = draft
