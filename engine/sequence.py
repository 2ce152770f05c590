"""Sequence: one request's tokens, KV blocks and generation state as the scheduler sees it."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto
from typing import TYPE_CHECKING, Any

from engine.outputs import FinishReason, TokenInfo
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.detokenizer import IncrementalDetokenizer
    from engine.stop import StopMatcher


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass(slots=True, eq=False)
class Sequence:
    """Prompt + generated tokens; the first `num_computed_tokens` of them are in the KV cache.

    `max_tokens` caps `num_tokens` (prompt + max_new_tokens, or max_total_tokens if smaller).
    Identity equality (eq=False): two requests with the same tokens are still two sequences.
    """

    seq_id: int
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    num_prompt_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_table_version: int = 0                            # bumped by any change but a tail append
    block_hashes: list[int] = field(default_factory=list)   # of full blocks, filled lazily
    num_registered_blocks: int = 0                          # leading blocks already in the prefix cache
    wants_prefill_logprobs: bool = False                    # until the first full prefill ran
    finish_reason: FinishReason | None = None
    seed: int | None = None
    generator: Any = None                                   # torch.Generator, created on first sample
    detokenizer: IncrementalDetokenizer | None = None
    stop: StopMatcher | None = None
    deferred: Any = None    # engine.deferred_text.DeferredText: its text is decoded where its outputs are delivered
    prefill_tokens: list[TokenInfo] | None = None
    num_cached_tokens: int | None = None    # prompt tokens found in the prefix cache at first admission
    grammar: Any = None     # llguidance.LLMatcher fed every generated token; kept across preemption (tokens are too)
    adapter: int = 0        # LoRA adapter index (engine/lora), 0 = the base model
    adapter_key: int = 0    # starts its prefix-cache chain: the adapter's, new each time a slot is loaded at run time
    draft_token_ids: list[int] = field(default_factory=list)  # speculative tokens scheduled this step
    ngram_index: Any = None                                   # engine.spec_decode.ngram.NgramIndex
    draft_history: Any = None                                 # engine.spec_decode.adaptive.DraftHistory (auto)
    images: Any = None      # engine.multimodal.MultiModalPrompt: the prompt's images (vision-language models)

    def __post_init__(self) -> None:
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.token_ids)
        self.wants_prefill_logprobs = self.params.prefill_logprobs

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def generated_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
