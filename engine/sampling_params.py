"""SamplingParams: TGI's generation parameters as the engine core sees them."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.structured.spec import GrammarSpec


@dataclass(slots=True)
class SamplingParams:
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    typical_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None                 # None + do_sample: the engine picks one and reports it
    max_new_tokens: int = 20
    stop: list[str] = field(default_factory=list)     # string-level, across token boundaries
    ignore_eos: bool = False
    top_n_tokens: int = 0                   # alternatives reported per generated token
    logprobs: bool = True                   # per-token logprob of the chosen token
    prefill_logprobs: bool = False          # decoder_input_details
    skip_special_tokens: bool = True
    grammar: GrammarSpec | None = None      # output constrained to it; the request ends when it is complete
    adapter_id: str | None = None           # a --lora-adapters name; None = the base model
