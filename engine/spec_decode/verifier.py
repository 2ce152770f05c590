"""Verify drafted rows: the sampler's processing at every drafted position, then acceptance."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.sampler import SamplerOutput, draw_uniform, process, report
from engine.sampling_params import SamplingParams
from engine.spec_decode.acceptance import accept_greedy, accept_sampled
from engine.structured.masks import TokenBitmask

if TYPE_CHECKING:
    from engine.sequence import Sequence


@dataclass(slots=True)
class DraftPosition:
    """Position j of a drafted sequence as the sampler sees it: the context is the sequence's tokens
    plus its first j draft tokens, so penalties count exactly what a token-by-token decode would."""

    seq: Sequence
    num_draft: int

    @property
    def params(self) -> SamplingParams:
        return self.seq.params

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids + self.seq.draft_token_ids[:self.num_draft]

    @property
    def num_prompt_tokens(self) -> int:
        return self.seq.num_prompt_tokens

    @property
    def seed(self) -> int | None:
        return self.seq.seed

    @property
    def generator(self) -> torch.Generator | None:
        return self.seq.generator

    @generator.setter
    def generator(self, value: torch.Generator) -> None:
        self.seq.generator = value


def verify(seqs: list[Sequence], logits: list[torch.Tensor],
           masks: dict[int, torch.Tensor] | None = None) -> list[SamplerOutput]:
    """For each drafted sequence and its logits [1 + k, vocab], the tokens it keeps (accepted drafts,
    then the corrected or bonus token) with their logprobs and alternatives, as `sample` reports them.
    `masks`: seq_id -> the grammar's bitmask at each of its 1 + k positions (engine.structured.masks)."""
    rows = [DraftPosition(seq, j) for seq in seqs for j in range(len(seq.draft_token_ids) + 1)]
    bitmask = None
    if masks:
        masked, bits, start = [], [], 0
        for seq in seqs:
            if seq.seq_id in masks:
                masked += range(start, start + len(seq.draft_token_ids) + 1)
                bits.append(masks[seq.seq_id])
            start += len(seq.draft_token_ids) + 1
        bitmask = TokenBitmask(masked, torch.cat(bits)) if bits else None
    processed = process(torch.cat(logits), rows, bitmask)
    outputs, start = [], 0
    for seq, row_logits in zip(seqs, logits):
        end = start + len(row_logits)
        if processed.sampling[start]:
            tokens = accept_sampled(processed.logprobs[start:end], seq.draft_token_ids,
                                    lambda row=rows[start]: draw_uniform(row))
        else:
            tokens = accept_greedy(processed.scores[start:end], seq.draft_token_ids)
        positions = processed.logprobs[start:start + len(tokens)]
        outputs.append(report(positions, torch.tensor(tokens, device=positions.device),
                              [seq.params] * len(tokens)))
        start = end
    return outputs
