"""Async scheduling: step N+1 is scheduled and launched before step N's tokens reach the host.

A synchronous step ends with the device idle: the sampled tokens are copied to the host, and only then does the host
append them, check stops, build the outputs, schedule the next batch and prepare its inputs. Here the tokens are
picked on the device (`sampler.pick_on_device`: greedy rows' argmax, sampling rows' draw with this step's uniform
from their own generator, drawn on the host as the synchronous sampler would, and the chosen logprob and
alternatives when a row reports them) and copied to pinned memory asynchronously; the next `LLMEngine.step()` builds
batch N+1 (`schedule_ahead`) and launches it, and only then waits for N's tokens and does N's host work while the
device runs N+1. Batch N+1: a decode for each sequence N samples, one position on, its token unknown (the runner
reads it from N's device tensor of picks, these rows first); then, as the scheduler would, the next prompt chunk of
each running sequence in its prompt and the waiting requests admitted, under the step's prefill budget (their tokens
are the host's). So traffic that keeps arriving rides in the steps ahead. The same idea as vLLM's and SGLang's
overlap schedulers.

What changes for a request: its tokens are delivered one step later than they are computed. A sequence that N's
token ends (end of sequence, a stop string) has already been put in N+1: that row is computed and thrown away,
and its blocks are freed (the device runs N+1 before any later batch that could reuse them, on one stream). One
whose length ends it at N is known in advance and left out.

When it applies (`LLMEngine._can_pick_ahead`): one rank or one node's tensor ranks (rank 0 broadcasts the decodes'
input ids to the others on the device: `RankWorker.execute`), greedy or sampling requests (temperature, top-k, top-p,
typical-p, penalties, grammars, alternatives or not), LoRA adapters or not (the worker moves each decode's input id
with its span when it groups the spans by adapter), images or not (a step ahead runs the vision encoder for its
prompt chunks before its launch, as the synchronous step does; decodes keep their M-RoPE offset), prompt logprobs
or not (a chunk's are computed on the device at the launch and copied with the picks: engine/prompt_logprobs.py),
no speculation. Penalties read the history up to the token in flight: N+1's decodes read that token from N's picks
on the device, and the penalty counts add it there (engine/penalty_counts.py), so nothing waits. A grammar's mask
needs the token on the host: while a live request has a grammar, N+1 is launched first and picked once N's tokens
are appended (its masks filled then, while the device runs N+1's forward: only the pick waits for N). Batch N+1 is
built only while every sequence's next token or chunk fits in its blocks or free ones (no preemption ahead);
otherwise N is resolved on its own and the next step is scheduled as usual. `--async-scheduling` auto: on with
CUDA. Off CUDA the runner is synchronous, so nothing overlaps; `on` there exercises the same state machine (tests).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.batch import SeqSpan
from engine.device_copy import copies_done, list_to_device, to_host
from engine.penalty_counts import PenaltyCounts
from engine.prompt_logprobs import PromptLogprobs
from engine.sampler import SamplerOutput, host_output, pick_on_device
from engine.scheduler import ScheduledBatch, Scheduler
from engine.sequence import Sequence
from engine.structured.masks import TokenBitmask

MODES = ("auto", "on", "off")


def resolve_mode(mode: str, device: torch.device | None, device_input_ids: bool) -> bool:
    """Whether an engine on `device` schedules ahead ("auto": on CUDA); `device_input_ids`: whether its runner
    takes a step's input ids on the device (`ModelRunner`: one rank, or one node's tensor ranks, which rank 0
    broadcasts them to; not the stages or nodes of an external launch)."""
    if mode not in MODES:
        raise ValueError(f"async_scheduling must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "off" or not device_input_ids:
        return False
    return mode == "on" or getattr(device, "type", None) == "cuda"


@dataclass(slots=True)
class InFlight:
    """A launched batch whose picks are still on their way to the host."""

    batch: ScheduledBatch
    sampled: list[Sequence]             # the sequences that get a token, one per pick (decodes, finished prompts)
    token_ids: torch.Tensor             # [len(sampled)] on the device: the next step's input ids
    host: list[torch.Tensor | None]     # the picks' ids, logprobs, top ids and logprobs (pinned copies on CUDA)
    done: torch.cuda.Event | None       # when they are written; None off CUDA (the copies were synchronous)
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)     # its chunks' prompt logprobs

    def resolve(self) -> SamplerOutput:
        """Wait for the copies; the picks as the sampler's output."""
        if self.done is not None:
            self.done.synchronize()
        return host_output(*(None if t is None else t.tolist() for t in self.host),
                           [seq.params for seq in self.sampled])


def pick(batch: ScheduledBatch, sampled: list[Sequence], logits: torch.Tensor, logprobs: bool,
         counts: PenaltyCounts | None = None, bitmask: TokenBitmask | None = None,
         in_flight: torch.Tensor | None = None) -> InFlight:
    """The picks of `logits` [len(sampled), vocab] on their device (`pick_on_device`; `counts`: the engine's
    penalty counts; `bitmask`: the grammar masks of the rows it names; `in_flight`: the first rows' tokens in
    flight, which their penalties count), their copy to the host started, not waited for."""
    picks = pick_on_device(logits, sampled, logprobs, counts, bitmask, in_flight)
    host = [to_host(t) for t in (picks.token_ids, picks.logprobs, picks.top_token_ids, picks.top_logprobs)]
    return InFlight(batch, sampled, picks.token_ids, host, copies_done(picks.token_ids.device))


def next_input_ids(inflight: InFlight, rows: list[int]) -> torch.Tensor:
    """Batch N+1's input ids: the device picks of batch N (`inflight`) at `rows`, not waited for."""
    if rows == list(range(len(inflight.sampled))):
        return inflight.token_ids
    return inflight.token_ids.index_select(0, list_to_device(rows, torch.int64, inflight.token_ids.device))


def sampled_rows(batch: ScheduledBatch) -> tuple[list[Sequence], list[int]]:
    """The sequences of a batch built ahead that sample (its decodes, first, and the prompts it completes) and
    their rows among the logits the runner returns (a row per span that asks for logits)."""
    sampled, rows, row = [], [], 0
    for seq, span in zip(batch.seqs, batch.spans):
        if span.logits == "none":
            continue
        if span.logits == "last" or span.start_pos + len(span.token_ids) == seq.num_tokens:
            sampled.append(seq)
            rows.append(row)
        row += 1
    return sampled, rows


def ends_at_length(seq: Sequence) -> bool:
    """Whether the token in flight for `seq` is its last by length (max_new_tokens, max_tokens)."""
    num_tokens = seq.num_tokens + 1
    return num_tokens - seq.num_prompt_tokens >= seq.params.max_new_tokens or num_tokens >= seq.max_tokens


def schedule_ahead(scheduler: Scheduler, inflight: InFlight) -> tuple[ScheduledBatch, list[int]] | None:
    """Batch N+1 while N is in flight: first a decode for each running sequence N samples (one position on, its
    token the one in flight), then the next prompt chunk of each running sequence in its prompt and the waiting
    requests admitted, as the scheduler would, under one prefill budget; and the rows of N's picks the decodes
    read. A decode past a prompt's images keeps its M-RoPE offset; a prompt chunk with images is encoded by the
    caller before the launch. None when the scheduler's general path must build it: a running sequence neither
    sampled by N nor in its prompt, or a sequence that needs a block and none is free (no preemption ahead)."""
    bm = scheduler.block_manager
    block_size = bm.block_size
    row_of = {seq.seq_id: row for row, seq in enumerate(inflight.sampled)}
    batch, rows, prompts = ScheduledBatch(), [], []
    for seq in scheduler.running:
        row = row_of.get(seq.seq_id)
        if row is None:     # its token is on the host: a prompt (or a recompute) goes on, a decode cannot be here
            if seq.num_uncomputed_tokens == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens:
                return None
            prompts.append(seq)
            continue
        if ends_at_length(seq):
            continue
        start = seq.num_tokens          # the position of the token in flight
        table = seq.block_table
        if start >= len(table) * block_size:
            if not bm.num_free_blocks:
                return None     # the blocks taken so far stay with their sequences: they need them next
            table.append(bm.take_free_block())
        batch.seqs.append(seq)
        batch.spans.append(SeqSpan(seq.seq_id, [0], start, table, "last", seq.adapter, seq.block_table_version,
                                   None, 0 if seq.images is None else seq.images.rope_delta))
        rows.append(row)
    batch.num_decode_tokens = len(batch.seqs)
    if (prompts or scheduler.waiting) and not scheduler.add_prefills_ahead(batch, prompts):
        return None
    return (batch, rows) if batch.seqs else None
