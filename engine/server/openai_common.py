"""What both OpenAI routes share: request checks, GenerateParameters, finish reasons, usage and streams."""
from __future__ import annotations

import contextlib
from collections.abc import Callable

from pydantic import BaseModel
from starlette.responses import Response

from engine.server import choices as fan
from engine.server import sse
from engine.server.choice_stream import open_choice_stream
from engine.server.errors import ServerError, ValidationError
from engine.server.infer import Generation, StreamEvent
from engine.server.protocol import GenerateParameters, OpenAIRequest, PromptTokensDetails, Usage
from engine.server.state import ServerState
from engine.server.streaming import Renderer
from engine.server.validation import ValidRequest
from engine.structured.spec import GrammarSpec

# a chunk builder gets (event or None for the usage chunk, usage or None)
ChunkBuilder = Callable[[StreamEvent | None, Usage | None], BaseModel]


def check_common(req: OpenAIRequest) -> None:
    if req.presence_penalty:
        raise ValidationError("`presence_penalty` is not supported by this server; use `frequency_penalty`")


def parameters(req: OpenAIRequest, max_tokens: int | None, top_n_tokens: int,
               grammar: GrammarSpec | None = None) -> GenerateParameters:
    # as in TGI: temperature 0 means greedy, anything else samples
    greedy = req.temperature == 0
    return GenerateParameters(
        do_sample=not greedy, temperature=None if greedy else req.temperature, top_p=req.top_p,
        frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty, seed=req.seed,
        max_new_tokens=max_tokens, stop=req.stop_list(), top_n_tokens=top_n_tokens or None, details=True,
        grammar=grammar)


def model_name(state: ServerState, req: OpenAIRequest) -> str:
    """The `model` a response names: the LoRA adapter that served it, else the served model."""
    return req.model if req.model in state.validator.adapters else state.model_name


def adapter_id(state: ServerState, req: OpenAIRequest) -> str | None:
    """`model` names a LoRA adapter (or the base model); a server without adapters ignores it, as TGI does."""
    return req.model if state.validator.adapters or state.config.enable_runtime_lora else None


def finish(gen: Generation | None) -> str | None:
    if gen is None:
        return None
    return "length" if gen.finish_reason == "length" else "stop"


def usage_of(gen: Generation) -> Usage:
    return Usage(prompt_tokens=gen.input_length, completion_tokens=gen.generated_tokens,
                 total_tokens=gen.input_length + gen.generated_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=gen.num_cached_tokens))


def renderer(chunk: ChunkBuilder, req: OpenAIRequest) -> Renderer:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def render(ev: StreamEvent, valid: ValidRequest) -> list[bytes]:
        chunks = [sse.encode_model(chunk(ev, None), space=True)]
        if ev.end is not None and include_usage:  # OpenAI: one more chunk, no choices, just usage
            chunks.append(sse.encode_model(chunk(None, usage_of(ev.end)), space=True))
        return chunks
    return render


def stream_choices(state: ServerState, req: OpenAIRequest, arrival: float, chunk: Callable[..., BaseModel],
                   build_groups: Callable[[], list[list[ValidRequest]]]) -> Response:
    """Several choices in one stream: admitted and validated now (real 429/422), then interleaved chunks,
    each with its choice index, and the usage chunk once all have ended."""
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    permit = contextlib.ExitStack()
    permit.enter_context(state.infer.permit())
    try:
        groups = build_groups()
    except ServerError:
        permit.close()
        raise

    def render(index: int, ev: StreamEvent) -> list[bytes]:
        return [sse.encode_model(chunk(ev, None, index), space=True)]

    def close(gens: list[list[Generation]]) -> list[bytes]:
        return [sse.encode_model(chunk(None, fan.usage(gens, gens)), space=True)] if include_usage else []
    return open_choice_stream(state, groups, arrival, render, close, permit)
