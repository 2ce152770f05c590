"""Scheduler: continuous batching with chunked prefill and preemption by recompute."""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.batch import SeqSpan
from engine.block_manager import BlockManager
from engine.outputs import FinishReason
from engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledBatch:
    """One model step: `spans[i]` runs `seqs[i]`."""

    seqs: list[Sequence] = field(default_factory=list)
    spans: list[SeqSpan] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_draft_tokens: int = 0       # speculative tokens riding on decode spans

    def __len__(self) -> int:
        return len(self.spans)


class Scheduler:
    """Every step: decode (and continue the prefill of) running sequences oldest first, then
    admit waiting ones FIFO.

    Prefill tokens (prompt chunks and recomputes) share a budget of `max_batch_prefill_tokens`
    per step; decodes never count against it, so a long prompt cannot starve running sequences.
    When the KV cache is full, the newest running sequence loses its blocks and goes back to the
    front of `waiting` with its generated tokens, to be recomputed later (nothing is lost). A waiting
    sequence is admitted only while its whole prompt and a block of growth per running sequence fit, so
    admissions do not cause the preemptions that would undo them.
    `max_batch_size` caps the running sequences. Unlike TGI's router, which reserves each
    request's whole max_new_tokens up front, blocks are taken as tokens arrive (hence preemption),
    and TGI's waiting_served_ratio is not needed: prefill chunks ride along with the decodes.

    A prefill chunk never ends inside an image whose tokens attend to each other both ways (Gemma 3): it stops
    before the image, which waits for a budget that takes it whole (LLMEngine refuses an image longer than the
    budget), so no image token is computed before its image's later tokens.

    `split_bursts` (CPU, where a step's time grows with its prompt tokens): when several prompts wait (requests
    that arrived together) and one step's budget would take them all, and they hold at least `split_bursts`
    tokens, the step admits the first half of them and the next step the rest, so half of the burst gets its
    first token after half the work instead of all of it (the median time to first token of a burst of equal
    prompts: 1.5 step overheads + 0.75 of the work, against 1 + 1), for one more step's fixed cost. A queue the
    budget does not take at once is spread over steps by the budget already.

    Speculation (`propose` set): a decode span carries up to `num_speculative_tokens` draft tokens
    after the real one (logits "all"). Drafts take prefill budget and only spare blocks, so they never
    cause a preemption. Their K/V counts as computed only once `commit_draft` says how many were
    accepted; the blocks past that are given back.
    """

    def __init__(self, block_manager: BlockManager, max_batch_prefill_tokens: int,
                 max_batch_size: int | None = None, num_speculative_tokens: int = 0,
                 propose: Callable[[Sequence, int], list[int]] | None = None, reserve_growth: bool = True,
                 split_bursts: int | None = None):
        if max_batch_prefill_tokens <= 0:
            raise ValueError(f"max_batch_prefill_tokens must be positive, got {max_batch_prefill_tokens}")
        self.block_manager = block_manager
        self.max_batch_prefill_tokens = max_batch_prefill_tokens
        self.max_batch_size = max_batch_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preempted_total = 0
        self.num_speculative_tokens = num_speculative_tokens if propose is not None else 0
        self.propose = propose
        self.reserve_growth = reserve_growth
        self.split_bursts = split_bursts
        self._split_pending = False     # the second half of a split burst waits: the next step takes it whole

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_batch_prefill_tokens
        num_preempted = self.num_preempted_total
        i = 0
        plain_decode = self._plain_decode if self.propose is None else None
        while i < len(self.running):
            seq = self.running[i]
            if plain_decode is not None and plain_decode(batch, seq):
                i += 1
                continue
            num_new = self._num_tokens_to_run(seq, budget)
            if num_new == 0:
                i += 1
                continue
            is_decode = num_new == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens
            seq.draft_token_ids = self._draft(seq, budget, len(self.running) - i - 1) if is_decode else []
            if not self._reserve(seq, num_new + len(seq.draft_token_ids)):
                break  # seq itself was preempted: it was the newest, nothing follows it
            self._add_span(batch, seq, num_new)
            if not is_decode:
                budget -= num_new
            budget -= len(seq.draft_token_ids)
            i += 1
        # admitting while preempting would only thrash
        if self.num_preempted_total == num_preempted:
            self._admit_waiting(batch, budget)
        return batch

    def add_prefills_ahead(self, batch: ScheduledBatch, seqs: list[Sequence]) -> bool:
        """Into `batch`, for a step launched before the previous one's tokens are read (engine/async_scheduling.py):
        the next prompt chunk of each of `seqs` (running, in their prompt), then waiting sequences admitted as
        `schedule` admits them, under one prefill budget, and never a preemption. False when a chunk needs blocks
        that only a preemption would free (`batch` may hold some spans then; their blocks stay with their
        sequences, which need them next)."""
        budget = self.max_batch_prefill_tokens
        bm = self.block_manager
        for seq in seqs:
            num_new = self._num_tokens_to_run(seq, budget)
            if num_new == 0:
                continue    # the budget is spent: it goes on in a later step
            if not bm.can_append(seq, seq.num_computed_tokens + num_new):
                return False
            bm.append(seq, seq.num_computed_tokens + num_new)
            self._add_span(batch, seq, num_new)
            budget -= num_new
        self._admit_waiting(batch, budget)
        return True

    def _plain_decode(self, batch: ScheduledBatch, seq: Sequence) -> bool:
        """The common case of `schedule`'s loop in one call (~4x cheaper at batch 256): a decode without
        drafts whose next token fits in its blocks or in a free one. False: nothing done, take the general
        path (a prefill chunk, a preemption to make room)."""
        token_ids, start = seq.token_ids, seq.num_computed_tokens
        if start != len(token_ids) - 1 or start < seq.num_prompt_tokens:
            return False
        table = seq.block_table
        if start >= len(table) * self.block_manager.block_size:
            if not self.block_manager.num_free_blocks:
                return False
            table.append(self.block_manager.take_free_block())
        if seq.draft_token_ids:
            seq.draft_token_ids = []
        images = seq.images
        batch.seqs.append(seq)
        batch.spans.append(SeqSpan(seq.seq_id, [token_ids[start]], start, table,
                                   "all" if seq.wants_prefill_logprobs else "last", seq.adapter,
                                   seq.block_table_version, images if images is not None and start < images.end
                                   else None, 0 if images is None else images.rope_delta))
        batch.num_decode_tokens += 1
        return True

    def _num_tokens_to_run(self, seq: Sequence, budget: int) -> int:
        num_uncomputed = seq.num_uncomputed_tokens
        if num_uncomputed == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens:
            return 1    # decode
        bm = self.block_manager
        # prefill chunk: take what fits in the free blocks before preempting anyone
        capacity = (len(seq.block_table) + bm.num_free_blocks) * bm.block_size - seq.num_computed_tokens
        if capacity <= 0:
            capacity = bm.block_size
        num_new = _whole_images(seq, seq.num_computed_tokens, min(num_uncomputed, budget, capacity))
        if num_new == 0:  # the free blocks end inside an image: preempt for it rather than stall
            num_new = _whole_images(seq, seq.num_computed_tokens, min(num_uncomputed, budget))
        return num_new

    def _draft(self, seq: Sequence, budget: int, num_after: int) -> list[int]:
        """Draft tokens for a decode of `seq`: none that could pass max_tokens (all accepted plus the
        bonus must fit), none past the budget, and none that need blocks the `num_after` decodes still to
        come might want. A grammar row's drafts are verified under the grammar's masks (engine/llm_engine.py)."""
        room = min(self.num_speculative_tokens, seq.max_tokens - seq.num_tokens - 1, budget)
        if room <= 0:
            return []
        draft = self.propose(seq, room)[:room]
        bm = self.block_manager
        needed = bm.num_blocks_for(seq.num_computed_tokens + 1 + len(draft)) - len(seq.block_table)
        return draft if draft and needed <= bm.num_free_blocks - num_after else []

    def _reserve(self, seq: Sequence, num_new: int) -> bool:
        """Grow `seq` by `num_new` tokens, preempting the newest running sequences if needed."""
        bm = self.block_manager
        num_tokens = seq.num_computed_tokens + num_new
        while not bm.can_append(seq, num_tokens):
            victim = self.running.pop()
            self.preempt(victim)
            if victim is seq:
                return False
        bm.append(seq, num_tokens)
        return True

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        bm = self.block_manager
        limit = self._burst_limit(budget)
        admitted = 0
        while self.waiting and budget > 0 and admitted < limit:
            if self.max_batch_size is not None and len(self.running) >= self.max_batch_size:
                break
            seq = self.waiting[0]
            num_cached = bm.num_cached_tokens(seq)
            num_new = _whole_images(seq, num_cached, min(seq.num_tokens - num_cached, budget))
            if num_new == 0:  # the budget left ends inside an image: the next step's budget takes it whole
                break
            if not bm.can_allocate(seq, num_cached + num_new) or self._prefix_in_flight(seq, num_cached):
                break
            # Admit only what the cache can carry on with: the whole prompt, and a block of growth for each
            # running sequence (the next `block_size` decode steps). Admitting on the first chunk alone
            # filled the cache with half-prefilled prompts that the decodes then preempted, recomputed and
            # preempted again (thrash: 3x the prompt tokens computed under pressure).
            if (self.reserve_growth and self.running
                    and not bm.can_allocate(seq, seq.num_tokens + len(self.running) * bm.block_size)):
                break
            bm.allocate(seq, num_cached + num_new)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._add_span(batch, seq, num_new)
            budget -= num_new
            admitted += 1

    def _burst_limit(self, budget: int) -> int:
        """How many waiting prompts this step may admit: the first half of a burst (see `split_bursts`), else any."""
        if self.split_bursts is None or self._split_pending or len(self.waiting) < 2:
            self._split_pending = False
            return len(self.waiting)
        tokens = 0
        for seq in self.waiting:
            tokens += seq.num_tokens
            if tokens > budget:  # the budget spreads this queue over steps already
                return len(self.waiting)
        if tokens < self.split_bursts:
            return len(self.waiting)
        self._split_pending = True
        return (len(self.waiting) + 1) // 2

    def _prefix_in_flight(self, seq: Sequence, num_cached: int) -> bool:
        """Whether a running sequence is computing the prompt block that follows `seq`'s cached prefix (a
        shared system prompt, requests that arrived together): `seq` then waits, and finds that block (and
        what follows) in the prefix cache a step later instead of computing it a second time."""
        bm = self.block_manager
        end = (num_cached // bm.block_size + 1) * bm.block_size  # one past the block after the cached ones
        if not bm.enable_prefix_caching or seq.wants_prefill_logprobs or end >= seq.num_tokens:
            return False
        index = end // bm.block_size - 1
        key = bm.prefix_key(seq, index)
        return any(other.num_computed_tokens < end <= other.num_prompt_tokens and bm.prefix_key(other, index) == key
                   for other in self.running)

    def _add_span(self, batch: ScheduledBatch, seq: Sequence, num_new: int) -> None:
        start = seq.num_computed_tokens
        end = start + num_new
        if seq.wants_prefill_logprobs or seq.draft_token_ids:
            logits = "all"
        else:
            logits = "last" if end == seq.num_tokens else "none"
        batch.seqs.append(seq)
        images = seq.images if seq.images is not None and start < seq.images.end else None
        batch.spans.append(SeqSpan(seq.seq_id, seq.token_ids[start:end] + seq.draft_token_ids, start,
                                   seq.block_table, logits, seq.adapter, seq.block_table_version, images,
                                   0 if seq.images is None else seq.images.rope_delta))
        batch.num_draft_tokens += len(seq.draft_token_ids)
        if end - start == 1 and start >= seq.num_prompt_tokens:
            batch.num_decode_tokens += 1
        else:
            batch.num_prefill_tokens += num_new

    def on_run_done(self, batch: ScheduledBatch) -> None:
        """The runner wrote the spans' K/V: advance each sequence (drafts wait for `commit_draft`) and
        feed the prefix cache."""
        bm = self.block_manager
        block_size = bm.block_size if bm.enable_prefix_caching else 0
        for seq, span in zip(batch.seqs, batch.spans):
            seq.num_computed_tokens += len(span.token_ids) - len(seq.draft_token_ids)
            if seq.wants_prefill_logprobs and seq.num_computed_tokens >= seq.num_prompt_tokens:
                seq.wants_prefill_logprobs = False
            if block_size and seq.num_computed_tokens // block_size > seq.num_registered_blocks:
                bm.mark_computed(seq)   # a block filled up (a no-op otherwise)

    def commit_draft(self, seq: Sequence, num_accepted: int) -> None:
        """`seq` kept its first `num_accepted` drafts and got one token after them (already appended):
        their K/V is computed; the rejected drafts' blocks go back, and full blocks join the prefix cache."""
        assert 0 <= num_accepted <= len(seq.draft_token_ids), (num_accepted, seq.draft_token_ids)
        seq.num_computed_tokens += num_accepted
        assert seq.num_computed_tokens == seq.num_tokens - 1, (seq.num_computed_tokens, seq.num_tokens)
        seq.draft_token_ids = []
        self.block_manager.truncate(seq, seq.num_tokens)
        self.block_manager.mark_computed(seq)

    def preempt(self, seq: Sequence) -> None:
        seq.draft_token_ids = []
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preempted_total += 1

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End `seq` (finished or aborted) wherever it is and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.draft_token_ids = []
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason


def _whole_images(seq: Sequence, start: int, num_new: int) -> int:
    """`num_new` cut back so that the chunk ends outside the image runs that attend both ways (Gemma 3)."""
    images = seq.images
    if images is None or not images.runs:
        return num_new
    return images.chunk_end(start, start + num_new) - start
