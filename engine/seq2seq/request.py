"""One request to an encoder-decoder: what the sampler reads (SampleRow), its encoder output and its decoder tokens."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams
from engine.stop import StopMatcher


@dataclass(slots=True)
class Seq2SeqRequest:
    """`token_ids` = prompt + generated, as the sampler's penalties and the detokenizer read them."""
    request_id: str
    params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int
    seed: int | None
    detokenizer: IncrementalDetokenizer
    stop: StopMatcher
    generator: Any = None
    encoded: torch.Tensor | None = None                     # [prompt tokens, d_model] encoder output
    decoder_ids: list[int] = field(default_factory=list)    # decoder start + generated tokens
