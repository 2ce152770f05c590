"""OpenAI-compatible routes: /v1/chat/completions (with response_format, tools, `n`), /v1/completions
(engine/server/completions.py), /v1/models.

Like TGI, requests become a GenerateRequest and go through the same validation and Infer; errors keep
TGI's {"error", "error_type"} body with the TGI status codes.
"""
from __future__ import annotations

import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute

from engine.server import choices as fan
from engine.server import sse
from engine.server.answer_text import AnswerStream
from engine.server.completions import completions
from engine.server.errors import ValidationError
from engine.server.grammar import prepare_grammars, response_format_grammar
from engine.server.infer import StreamEvent
from engine.server.openai_common import (adapter_id, check_common, finish, model_name, parameters, renderer,
                                         stream_choices, usage_of)
from engine.server.openai_requests import apply_chat_template, chat_choice, chat_logprobs, prefetch_images
from engine.server.protocol import (ChatChunkChoice, ChatCompletion, ChatCompletionChunk, ChatCompletionRequest,
                                    ChatDelta, GenerateRequest, ModelCard, ModelList, Usage, dump)
from engine.server.reasoning import ReasoningFormat, for_prompt, reasoning_format, reasoning_stream
from engine.server.reasoning_request import request_grammar
from engine.server.routing import ExactRoute
from engine.server.state import ServerState
from engine.server.streaming import Renderer, open_stream, unless_disconnected
from engine.server.tools import ToolUse, new_call_id, tool_use
from engine.server.validation import ValidRequest, parse_body



async def chat_completions(request: Request) -> Response:
    state: ServerState = request.app.state.server
    with state.request() as arrival:
        body = await request.body()
        await prepare_grammars(body, state.engine)   # before parsing: a huge schema is refused unparsed
        req = parse_body(ChatCompletionRequest, body)
        check_common(req)
        n = req.n or 1
        fan.check_counts(1, n, n, state.config.max_concurrent_requests)
        use = tool_use(req, state.tokenizer, state.config.tool_call_parser)
        if req.stream and n > 1 and use is not None:
            raise ValidationError("`n` > 1 with `tools` is not supported when streaming")
        grammar = response_format_grammar(req.response_format)
        if use is not None and grammar is not None:
            raise ValidationError('`response_format` cannot be combined with `tools` unless `tool_choice` is "none"')
        top_n = (req.top_logprobs or 0) if req.logprobs else 0
        if top_n > state.config.max_top_n_tokens:
            raise ValidationError(f"`top_logprobs` must be <= {state.config.max_top_n_tokens}. Given: {top_n}")
        prompt = apply_chat_template(state, req, use)
        await prefetch_images(state, prompt, add_special_tokens=False)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        thinks = reasoning_format(state.config.reasoning_parser, getattr(state.tokenizer, "chat_template", None))
        grammar = request_grammar(req, thinks, use, grammar, prompt, state.tokenizer)
        thinks = for_prompt(thinks, prompt)
        params = parameters(req, max_tokens, top_n, grammar)
        params.adapter_id = adapter_id(state, req)
        created, rid, logprobs = int(time.time()), f"chatcmpl-{uuid.uuid4().hex}", bool(req.logprobs)
        if req.stream and use is not None:
            return open_stream(state, GenerateRequest(inputs=prompt, parameters=params), arrival,
                               _tool_renderer(state, req, use, thinks, rid, created), openai=True,
                               add_special_tokens=False)
        if req.stream:
            reasoning_streams: dict[int, Any] = {}

            def chunk(ev: StreamEvent | None, usage: Usage | None, index: int = 0) -> ChatCompletionChunk:
                choices = [] if ev is None else [ChatChunkChoice(
                    index=index, delta=_delta(ev, thinks, reasoning_streams, index),
                    logprobs=chat_logprobs([ev.token]) if logprobs else None, finish_reason=finish(ev.end))]
                return ChatCompletionChunk(id=rid, created=created, model=model_name(state, req), usage=usage,
                                           system_fingerprint=state.system_fingerprint, choices=choices)
            if n > 1:
                return stream_choices(state, req, arrival, chunk, lambda: [fan.fan_out(state.validator.validate(
                    GenerateRequest(inputs=prompt, parameters=params), stream=True, add_special_tokens=False),
                    n, req.seed, prompt_logprobs=False)])
            return open_stream(state, GenerateRequest(inputs=prompt, parameters=params), arrival,
                               renderer(chunk, req), openai=True, add_special_tokens=False)
        with state.infer.permit():
            valid = state.validator.validate(GenerateRequest(inputs=prompt, parameters=params),
                                             add_special_tokens=False)
            groups = [fan.fan_out(valid, n, req.seed, prompt_logprobs=False)]
            gens = await unless_disconnected(request, state.infer.generate_groups(
                groups, arrival, state.config.prefix_caching))
        choices = [chat_choice(gen, use, logprobs, index, thinks) for index, gen in enumerate(gens[0])]
        body = ChatCompletion(id=rid, created=created, model=model_name(state, req), choices=choices,
                              usage=fan.usage(gens, gens), system_fingerprint=state.system_fingerprint)
        return JSONResponse(dump(body))


def _delta(ev: StreamEvent, thinks: ReasoningFormat | None, streams: dict[int, Any],
           index: int) -> ChatDelta:
    if thinks is None:
        return ChatDelta(content=ev.text)
    stream = streams.setdefault(index, reasoning_stream(thinks))
    pieces = stream.feed(ev.text) + (stream.finish() if ev.end is not None else [])
    content = "".join(text for kind, text in pieces if kind == "content")
    reasoning = "".join(text for kind, text in pieces if kind == "reasoning")
    return ChatDelta(content=content if content or not reasoning else None, reasoning_content=reasoning or None)


async def models(request: Request) -> Response:
    state: ServerState = request.app.state.server
    cards = [ModelCard(id=state.model_name, owned_by="tgi-hpc", task=state.info.task)]
    cards += [ModelCard(id=name, owned_by="tgi-hpc") for name in state.validator.adapters]  # LoRA adapters
    return JSONResponse(dump(ModelList(data=cards)))


ROUTES: list[BaseRoute] = [
    ExactRoute("/v1/chat/completions", chat_completions, methods=["POST"]),
    ExactRoute("/v1/completions", completions, methods=["POST"]),
    ExactRoute("/v1/models", models, methods=["GET"]),
]


# --- responses ----------------------------------------------------------------------------------

def _tool_renderer(state: ServerState, req: ChatCompletionRequest, use: ToolUse, thinks: ReasoningFormat | None,
                   rid: str, created: int) -> Renderer:
    """OpenAI's tool-call stream: each call's `index`, id and name in one delta, then its arguments in pieces (with
    its index), then an empty delta with finish_reason "tool_calls"; plain text (under `auto`) streams as
    content."""
    pieces = AnswerStream(use, thinks)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def chunk(delta: ChatDelta | None, finish: str | None, usage: Usage | None = None) -> bytes:
        choices = [] if delta is None else [ChatChunkChoice(delta=delta, finish_reason=finish)]
        return sse.encode_model(ChatCompletionChunk(
            id=rid, created=created, model=model_name(state, req), usage=usage,
            system_fingerprint=state.system_fingerprint, choices=choices), space=True)

    def delta(kind: str, text: str, index: int) -> ChatDelta:
        if kind == "content":
            return ChatDelta(content=text)
        if kind == "reasoning":
            return ChatDelta(content=None, reasoning_content=text)
        call: dict[str, Any] = {"index": index, "function": {"arguments": text}}
        if kind == "name":
            call = {"index": index, "id": new_call_id(use.fmt), "type": "function",
                    "function": {"name": text, "arguments": ""}}
        return ChatDelta(content=None, tool_calls=[call])

    def render(ev: StreamEvent, valid: ValidRequest) -> list[bytes]:
        chunks = [chunk(delta(*piece), None) for piece in pieces.feed(ev.text, ev.end)]
        if ev.end is None:
            return chunks
        chunks.append(chunk(ChatDelta(content=None), "tool_calls" if pieces.calls and ev.end.finish_reason != "length"
                            else finish(ev.end)))
        if include_usage:
            chunks.append(chunk(None, None, usage_of(ev.end)))
        return chunks
    return render


