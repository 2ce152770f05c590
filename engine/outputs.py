"""What the engine core reports per step; no HTTP types here."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

FinishReason = Literal["length", "eos_token", "stop_sequence", "aborted"]


@dataclass(slots=True)
class TokenInfo:
    id: int
    text: str                               # this token's own text (tokenizer.decode([id]))
    logprob: float | None
    special: bool
    top_tokens: Sequence["TokenInfo"] = ()     # the alternatives asked for (top_n_tokens); () when none: no list


@dataclass(slots=True)
class RequestOutput:
    """One step's news for one request: zero or more new tokens, and the end if it came."""

    request_id: str
    tokens: list[TokenInfo]                 # new generated tokens this step
    text: str                               # new text this step (incremental detokenizer; held back until stable)
    finished: bool = False
    finish_reason: FinishReason | None = None
    generated_text: str | None = None       # whole text, on the final output only (stop sequence cut off)
    stop_text: str = ""                     # final output: what the stop sequence cut (TGI reports it, OpenAI not)
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    seed: int | None = None
    prefill_tokens: list[TokenInfo] | None = None  # with prefill_logprobs, on the first output
    num_cached_tokens: int = 0              # prompt tokens read from the prefix cache instead of computed
    error: str | None = None                # set when the engine failed this request
    token_texts: list[str] | None = None    # `text` split per token of `tokens` (several with speculation)
    # (DeferredText, first, upto, final) while the text is not decoded yet: engine/deferred_text.py's `fill`
    pending: tuple | None = None
