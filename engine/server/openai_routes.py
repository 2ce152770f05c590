"""OpenAI-compatible routes: /v1/chat/completions (with response_format and tools), /v1/completions (prompts as
text or token ids, batched; echo, legacy logprobs, scoring with max_tokens 0), /v1/models; `n` and `best_of`.

Like TGI, requests become a GenerateRequest and go through the same validation and Infer; errors keep
TGI's {"error", "error_type"} body with the TGI status codes.
"""
from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute

from engine.server import choices as fan
from engine.server import sse
from engine.server.choice_stream import open_choice_stream
from engine.server.errors import ServerError, ValidationError
from engine.server.infer import Generation, StreamEvent
from engine.server.legacy_logprobs import completion_logprobs, stream_logprobs
from engine.server.protocol import (ChatChunkChoice, ChatCompletion, ChatCompletionChoice, ChatCompletionChunk,
                                    ChatCompletionMessage, ChatCompletionRequest, ChatDelta, ChatLogprob, ChatLogprobs,
                                    ChatToolCall, Completion, CompletionChoice, CompletionRequest, FunctionCall,
                                    GenerateParameters, GenerateRequest, ModelCard, ModelList, OpenAIRequest,
                                    PromptTokensDetails, TopLogprob, Usage, dump)
from engine.server.routing import ExactRoute
from engine.server.state import ServerState
from engine.server.streaming import Renderer, open_stream, unless_disconnected
from engine.server.grammar import response_format_grammar
from engine.server.tools import ToolUse, new_call_id, template_inputs, tool_use
from engine.server.validation import ValidRequest, parse_body
from engine.structured.spec import GrammarSpec
from engine.structured.tool_calls import ToolCallStream, parse_tool_call

# a chunk builder gets (event or None for the usage chunk, usage or None)
ChunkBuilder = Callable[[StreamEvent | None, Usage | None], dict[str, Any]]
COMPLETIONS_MAX_TOKENS = 16     # OpenAI's documented default for /v1/completions (vLLM's too)


async def chat_completions(request: Request) -> Response:
    state: ServerState = request.app.state.server
    with state.request() as arrival:
        req = parse_body(ChatCompletionRequest, await request.body())
        _check_common(req)
        n = req.n or 1
        fan.check_counts(1, n, n, state.config.max_concurrent_requests)
        use = tool_use(req, state.tokenizer)
        if req.stream and n > 1 and use is not None:
            raise ValidationError("`n` > 1 with `tools` is not supported when streaming")
        grammar = response_format_grammar(req.response_format)
        if use is not None and grammar is not None:
            raise ValidationError('`response_format` cannot be combined with `tools` unless `tool_choice` is "none"')
        top_n = (req.top_logprobs or 0) if req.logprobs else 0
        if top_n > state.config.max_top_n_tokens:
            raise ValidationError(f"`top_logprobs` must be <= {state.config.max_top_n_tokens}. Given: {top_n}")
        prompt = _apply_chat_template(state, req, use)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = _parameters(req, max_tokens, top_n,
                             use.grammar if use is not None else grammar)
        created, rid, logprobs = int(time.time()), f"chatcmpl-{uuid.uuid4().hex}", bool(req.logprobs)
        if req.stream and use is not None:
            return open_stream(state, GenerateRequest(inputs=prompt, parameters=params), arrival,
                               _tool_renderer(state, req, use, rid, created), openai=True, add_special_tokens=False)
        if req.stream:
            def chunk(ev: StreamEvent | None, usage: Usage | None, index: int = 0) -> dict[str, Any]:
                choices = [] if ev is None else [ChatChunkChoice(
                    index=index, delta=ChatDelta(content=ev.text),
                    logprobs=_chat_logprobs([ev.token]) if logprobs else None, finish_reason=_finish(ev.end))]
                return dump(ChatCompletionChunk(id=rid, created=created, model=state.model_name, usage=usage,
                                                system_fingerprint=state.system_fingerprint, choices=choices))
            if n > 1:
                return _stream_choices(state, req, arrival, chunk, lambda: [fan.fan_out(state.validator.validate(
                    GenerateRequest(inputs=prompt, parameters=params), stream=True, add_special_tokens=False),
                    n, req.seed, prompt_logprobs=False)])
            return open_stream(state, GenerateRequest(inputs=prompt, parameters=params), arrival,
                               _renderer(chunk, req), openai=True, add_special_tokens=False)
        with state.infer.permit():
            valid = state.validator.validate(GenerateRequest(inputs=prompt, parameters=params),
                                             add_special_tokens=False)
            groups = [fan.fan_out(valid, n, req.seed, prompt_logprobs=False)]
            gens = await unless_disconnected(request, state.infer.generate_groups(
                groups, arrival, state.config.prefix_caching))
        choices = [_chat_choice(gen, use, logprobs, index) for index, gen in enumerate(gens[0])]
        body = ChatCompletion(id=rid, created=created, model=state.model_name, choices=choices,
                              usage=fan.usage(gens, gens), system_fingerprint=state.system_fingerprint)
        return JSONResponse(dump(body))


def _chat_choice(gen: Generation, use: ToolUse | None, logprobs: bool, index: int) -> ChatCompletionChoice:
    call = parse_tool_call(gen.text, use.fmt, use.tools) if use is not None else None
    message = ChatCompletionMessage(content=gen.text) if call is None else ChatCompletionMessage(
        content=None, tool_calls=[ChatToolCall(id=new_call_id(), function=FunctionCall(
            name=call.name, arguments=call.arguments))])
    return ChatCompletionChoice(index=index, message=message, finish_reason="tool_calls" if call else _finish(gen),
                                logprobs=_chat_logprobs(gen.tokens) if logprobs else None)


async def completions(request: Request) -> Response:
    state: ServerState = request.app.state.server
    with state.request() as arrival:
        req = parse_body(CompletionRequest, await request.body())
        _check_completion(state, req)
        prompts = req.prompts()
        n = req.n or 1
        best_of = req.best_of if req.best_of is not None else n
        fan.check_counts(len(prompts), n, best_of, state.config.max_concurrent_requests)
        scoring = req.max_tokens == 0  # echo + max_tokens 0: score the prompt, generate nothing
        params = _parameters(req, 1 if scoring else req.max_tokens, req.logprobs or 0,
                             response_format_grammar(req.response_format))
        default = min(COMPLETIONS_MAX_TOKENS, state.config.max_new_tokens_default or COMPLETIONS_MAX_TOKENS)
        created, rid = int(time.time()), f"cmpl-{uuid.uuid4().hex}"
        if req.stream and (len(prompts) > 1 or n > 1):
            offsets: dict[int, int] = {}

            def chunk(ev: StreamEvent | None, usage: Usage | None, index: int = 0) -> dict[str, Any]:
                choices = []
                if ev is not None:
                    offset = offsets.get(index, 0)
                    logprobs = stream_logprobs(ev.token, ev.text, offset) if req.logprobs is not None else None
                    offsets[index] = offset + len(ev.text)
                    choices = [CompletionChoice(index=index, text=ev.text, logprobs=logprobs,
                                                finish_reason=_finish(ev.end))]
                return dump(Completion(id=rid, created=created, model=state.model_name, usage=usage,
                                       system_fingerprint=state.system_fingerprint, choices=choices))
            return _stream_choices(state, req, arrival, chunk, lambda: [
                fan.fan_out(_validate(state, p, params, default, stream=True), n, req.seed, prompt_logprobs=False)
                for p in prompts])
        if req.stream:
            ids = None if isinstance(prompts[0], str) else prompts[0]
            return open_stream(state, _generate_request(state, prompts[0], params), arrival,
                               _completion_stream(state, req, rid, created), openai=True, prompt_token_ids=ids,
                               max_new_tokens_default=default)
        with state.infer.permit():
            groups = [fan.fan_out(_validate(state, prompt, params, default), best_of, req.seed,
                                  prompt_logprobs=req.echo and req.logprobs is not None) for prompt in prompts]
            gens = await unless_disconnected(request, state.infer.generate_groups(
                groups, arrival, state.config.prefix_caching))
        returned = [fan.best(g, n) for g in gens]
        choices = [_completion_choice(state, req, group[0], gen, prompt_gens[0].prefill, i * n + j, scoring)
                   for i, (group, prompt_gens, kept) in enumerate(zip(groups, gens, returned))
                   for j, gen in enumerate(kept)]
        body = Completion(id=rid, created=created, model=state.model_name, choices=choices,
                          usage=fan.usage(gens, returned, count_completion=not scoring),
                          system_fingerprint=state.system_fingerprint)
        return JSONResponse(dump(body))


def _check_completion(state: ServerState, req: CompletionRequest) -> None:
    _check_common(req)
    if req.suffix:
        raise ValidationError("Suffix is not supported and can be achieved by preprocessing the prompt.")
    if req.logprobs is not None and req.logprobs > state.config.max_top_n_tokens:
        raise ValidationError(f"`logprobs` must be <= {state.config.max_top_n_tokens}. Given: {req.logprobs}")
    if req.max_tokens == 0 and not req.echo:
        raise ValidationError("`max_tokens` 0 generates nothing: it needs `echo` (scoring the prompt)")
    if req.echo and req.stream:
        raise ValidationError("`echo` is not supported when streaming")
    if req.stream and (req.best_of or 1) > (req.n or 1):
        raise ValidationError("`best_of` must equal `n` when streaming (the best are known only at the end)")


def _generate_request(state: ServerState, prompt: str | list[int], params: GenerateParameters) -> GenerateRequest:
    if isinstance(prompt, str):
        return GenerateRequest(inputs=prompt, parameters=params)
    # a token-id prompt's text is only shown by `echo`; ids outside the vocabulary never reach the tokenizer
    text = state.tokenizer.decode(state.validator.check_token_ids(prompt), skip_special_tokens=True)
    return GenerateRequest(inputs=text, parameters=params)


def _validate(state: ServerState, prompt: str | list[int], params: GenerateParameters, default: int,
              stream: bool = False) -> ValidRequest:
    ids = None if isinstance(prompt, str) else prompt
    return state.validator.validate(_generate_request(state, prompt, params), prompt_token_ids=ids,
                                    max_new_tokens_default=default, stream=stream)


def _stream_choices(state: ServerState, req: OpenAIRequest, arrival: float, chunk: Callable[..., dict[str, Any]],
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
        return [sse.encode_event(chunk(ev, None, index), space=True)]

    def close(gens: list[list[Generation]]) -> list[bytes]:
        return [sse.encode_event(chunk(None, fan.usage(gens, gens)), space=True)] if include_usage else []
    return open_choice_stream(state, groups, arrival, render, close, permit)


def _completion_choice(state: ServerState, req: CompletionRequest, valid: ValidRequest, gen: Generation,
                       prefill: list[Any], index: int, scoring: bool) -> CompletionChoice:
    generated = [] if scoring else gen.tokens
    text = (valid.inputs if req.echo else "") + ("" if scoring else gen.text)
    logprobs = None
    if req.logprobs is not None:
        logprobs = completion_logprobs(state.tokenizer, valid.prompt_token_ids, prefill if req.echo else None,
                                       generated)
    return CompletionChoice(index=index, text=text, logprobs=logprobs,
                            finish_reason="length" if scoring else _finish(gen))


def _completion_stream(state: ServerState, req: CompletionRequest, rid: str, created: int) -> Renderer:
    offset = 0

    def chunk(ev: StreamEvent | None, usage: Usage | None) -> dict[str, Any]:
        nonlocal offset
        choices = []
        if ev is not None:
            logprobs = stream_logprobs(ev.token, ev.text, offset) if req.logprobs is not None else None
            offset += len(ev.text)
            choices = [CompletionChoice(text=ev.text, logprobs=logprobs, finish_reason=_finish(ev.end))]
        return dump(Completion(id=rid, created=created, model=state.model_name, usage=usage,
                               system_fingerprint=state.system_fingerprint, choices=choices))
    return _renderer(chunk, req)


async def models(request: Request) -> Response:
    state: ServerState = request.app.state.server
    return JSONResponse(dump(ModelList(data=[ModelCard(id=state.model_name, owned_by="tgi-hpc")])))


ROUTES: list[BaseRoute] = [
    ExactRoute("/v1/chat/completions", chat_completions, methods=["POST"]),
    ExactRoute("/v1/completions", completions, methods=["POST"]),
    ExactRoute("/v1/models", models, methods=["GET"]),
]


# --- request -> GenerateParameters --------------------------------------------------------------

def _check_common(req: OpenAIRequest) -> None:
    if req.presence_penalty:
        raise ValidationError("`presence_penalty` is not supported by this server; use `frequency_penalty`")


def _parameters(req: OpenAIRequest, max_tokens: int | None, top_n_tokens: int,
                grammar: GrammarSpec | None = None) -> GenerateParameters:
    # as in TGI: temperature 0 means greedy, anything else samples
    greedy = req.temperature == 0
    return GenerateParameters(
        do_sample=not greedy, temperature=None if greedy else req.temperature, top_p=req.top_p,
        frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty, seed=req.seed,
        max_new_tokens=max_tokens, stop=req.stop_list(), top_n_tokens=top_n_tokens or None, details=True,
        grammar=grammar)


def _apply_chat_template(state: ServerState, req: ChatCompletionRequest, use: ToolUse | None) -> str:
    if not getattr(state.tokenizer, "chat_template", None):
        raise ValidationError("this model has no chat template; use /v1/completions or /generate")
    for message in req.messages:
        if isinstance(message.content, list) and any(p.type != "text" for p in message.content):
            raise ValidationError("only text content parts are supported")
    messages, tools = template_inputs(req, state.tokenizer, use)
    try:
        extra = {"tools": tools} if tools else {}
        return str(state.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra))
    except Exception as exc:  # jinja errors (e.g. "roles must alternate") are the caller's to fix
        raise ValidationError(f"chat template error: {exc}") from None


# --- responses ----------------------------------------------------------------------------------

def _finish(gen: Generation | None) -> str | None:
    if gen is None:
        return None
    return "length" if gen.finish_reason == "length" else "stop"


def _usage(gen: Generation) -> Usage:
    return Usage(prompt_tokens=gen.input_length, completion_tokens=gen.generated_tokens,
                 total_tokens=gen.input_length + gen.generated_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=gen.num_cached_tokens))


def _chat_logprobs(tokens: list[Any]) -> ChatLogprobs:
    return ChatLogprobs(content=[
        ChatLogprob(token=t.text, logprob=t.logprob or 0.0,
                    top_logprobs=[TopLogprob(token=a.text, logprob=a.logprob or 0.0) for a in t.top_tokens])
        for t in tokens])


def _tool_renderer(state: ServerState, req: ChatCompletionRequest, use: ToolUse, rid: str,
                   created: int) -> Renderer:
    """OpenAI's tool-call stream: the call's id and name in one delta, then its arguments in pieces, then an
    empty delta with finish_reason "tool_calls"; plain text (under `auto`) streams as content."""
    pieces = ToolCallStream(use.fmt, use.tools, use.allow_text)
    call_id = new_call_id()
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def chunk(delta: ChatDelta | None, finish: str | None, usage: Usage | None = None) -> bytes:
        choices = [] if delta is None else [ChatChunkChoice(delta=delta, finish_reason=finish)]
        return sse.encode_event(dump(ChatCompletionChunk(
            id=rid, created=created, model=state.model_name, usage=usage,
            system_fingerprint=state.system_fingerprint, choices=choices)), space=True)

    def delta(kind: str, text: str) -> ChatDelta:
        if kind == "content":
            return ChatDelta(content=text)
        call: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
        if kind == "name":
            call = {"index": 0, "id": call_id, "type": "function", "function": {"name": text, "arguments": ""}}
        return ChatDelta(content=None, tool_calls=[call])

    def render(ev: StreamEvent, valid: ValidRequest) -> list[bytes]:
        out = pieces.feed(ev.text)
        if ev.end is None:
            return [chunk(delta(kind, text), None) for kind, text in out]
        last, call = pieces.finish(ev.end.text)
        chunks = [chunk(delta(kind, text), None) for kind, text in out + last]
        chunks.append(chunk(ChatDelta(content=None), "tool_calls" if call else _finish(ev.end)))
        if include_usage:
            chunks.append(chunk(None, None, _usage(ev.end)))
        return chunks
    return render


def _renderer(chunk: ChunkBuilder, req: OpenAIRequest) -> Renderer:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def render(ev: StreamEvent, valid: ValidRequest) -> list[bytes]:
        chunks = [sse.encode_event(chunk(ev, None), space=True)]
        if ev.end is not None and include_usage:  # OpenAI: one more chunk, no choices, just usage
            chunks.append(sse.encode_event(chunk(None, _usage(ev.end)), space=True))
        return chunks
    return render
