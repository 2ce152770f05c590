"""Stand-ins for the sequences the sampler reads (the fields `engine.sampler.sample` uses), for the penalty tests."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.sampling_params import SamplingParams


@dataclass(eq=False)
class Row:
    seq_id: int
    params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int
    seed: int | None = None
    generator: torch.Generator | None = field(default=None)


@dataclass(eq=False)
class AnonymousRow:     # as the verifier's draft positions: no seq_id
    params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int
    seed: int | None = None
    generator: torch.Generator | None = None
