"""The engine's own checks of one request (prompt ids and sampling parameters), shared by every engine class.

The server validates requests before they reach an engine (422s with TGI's messages); these checks are the
engines' last line for callers that skip it (the offline batch, the Python API, tests). Each raises ValueError.
"""
from __future__ import annotations

from engine.config import EngineConfig
from engine.sampling_params import SamplingParams


def check_request(prompt_token_ids: list[int], params: SamplingParams, config: EngineConfig, *,
                  max_input_tokens: int, vocab_size: int) -> None:
    if not prompt_token_ids:
        raise ValueError("the prompt is empty: at least one input token is needed")
    if len(prompt_token_ids) > max_input_tokens:
        raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens, more than "
                         f"max_input_tokens={max_input_tokens}")
    if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab_size:
        raise ValueError(f"prompt token ids must lie in [0, {vocab_size})")
    if params.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {params.max_new_tokens}")
    if params.temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {params.temperature} (use do_sample=false for greedy)")
    if params.repetition_penalty is not None and params.repetition_penalty <= 0:
        raise ValueError(f"repetition_penalty must be > 0, got {params.repetition_penalty}")
    for name in ("top_p", "typical_p"):
        value = getattr(params, name)
        if value is not None and not 0 < value <= 1:
            raise ValueError(f"{name} must be in (0, 1], got {value}")
    if params.top_k is not None and params.top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {params.top_k}")
    if not 0 <= params.top_n_tokens <= config.max_top_n_tokens:
        raise ValueError(f"top_n_tokens must be in [0, {config.max_top_n_tokens}], got {params.top_n_tokens}")
    if len(params.stop) > config.max_stop_sequences:
        raise ValueError(f"at most {config.max_stop_sequences} stop sequences, got {len(params.stop)}")
