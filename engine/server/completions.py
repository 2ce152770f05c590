"""/v1/completions: prompts as text or token ids (batched), echo, legacy logprobs, scoring with max_tokens 0,
n and best_of."""
from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.server import choices as fan
from engine.server.errors import ValidationError
from engine.server.grammar import prepare_grammars, response_format_grammar
from engine.server.infer import Generation, StreamEvent
from engine.server.legacy_logprobs import completion_logprobs, stream_logprobs
from engine.server.openai_common import adapter_id, check_common, finish, model_name, parameters, stream_choices
from engine.server.protocol import (Completion, CompletionChoice, CompletionRequest, GenerateParameters,
                                    GenerateRequest, Usage, dump)
from engine.server.state import ServerState
from engine.server.streaming import unless_disconnected
from engine.server.validation import ValidRequest, parse_body

COMPLETIONS_MAX_TOKENS = 16     # OpenAI's documented default for /v1/completions (vLLM's too)


async def completions(request: Request) -> Response:
    state: ServerState = request.app.state.server
    with state.request() as arrival:
        body = await request.body()
        await prepare_grammars(body, state.engine)   # before parsing: a huge schema is refused unparsed
        req = parse_body(CompletionRequest, body)
        _check_completion(state, req)
        prompts = req.prompts()
        n = req.n or 1
        best_of = req.best_of if req.best_of is not None else n
        fan.check_counts(len(prompts), n, best_of, state.config.max_concurrent_requests)
        scoring = req.max_tokens == 0  # echo + max_tokens 0: score the prompt, generate nothing
        params = parameters(req, 1 if scoring else req.max_tokens, req.logprobs or 0,
                            response_format_grammar(req.response_format))
        params.adapter_id = adapter_id(state, req)
        default = min(COMPLETIONS_MAX_TOKENS, state.config.max_new_tokens_default or COMPLETIONS_MAX_TOKENS)
        created, rid = int(time.time()), f"cmpl-{uuid.uuid4().hex}"
        if req.stream:
            return stream_choices(state, req, arrival, _chunk_builder(state, req, rid, created), lambda: [
                fan.fan_out(_validate(state, p, params, default, stream=True), n, req.seed, prompt_logprobs=False)
                for p in prompts])
        with state.infer.permit():
            groups = [fan.fan_out(_validate(state, prompt, params, default), best_of, req.seed,
                                  prompt_logprobs=req.echo and req.logprobs is not None) for prompt in prompts]
            gens = await unless_disconnected(request, state.infer.generate_groups(
                groups, arrival, state.config.prefix_caching))
        returned = [fan.best(g, n) for g in gens]
        choices = [_completion_choice(state, req, group[0], gen, prompt_gens[0].prefill, i * n + j, scoring)
                   for i, (group, prompt_gens, kept) in enumerate(zip(groups, gens, returned))
                   for j, gen in enumerate(kept)]
        body = Completion(id=rid, created=created, model=model_name(state, req), choices=choices,
                          usage=fan.usage(gens, returned, count_completion=not scoring),
                          system_fingerprint=state.system_fingerprint)
        return JSONResponse(dump(body))


def _check_completion(state: ServerState, req: CompletionRequest) -> None:
    check_common(req)
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


def _completion_choice(state: ServerState, req: CompletionRequest, valid: ValidRequest, gen: Generation,
                       prefill: list[Any], index: int, scoring: bool) -> CompletionChoice:
    generated = [] if scoring else gen.tokens
    text = (valid.inputs if req.echo else "") + ("" if scoring else gen.text)
    logprobs = None
    if req.logprobs is not None:
        logprobs = completion_logprobs(state.tokenizer, valid.prompt_token_ids, prefill if req.echo else None,
                                       generated)
    return CompletionChoice(index=index, text=text, logprobs=logprobs,
                            finish_reason="length" if scoring else finish(gen))


def _chunk_builder(state: ServerState, req: CompletionRequest, rid: str,
                   created: int) -> Callable[..., dict[str, Any]]:
    offsets: dict[int, int] = {}    # per choice: where the next piece starts in its text

    def chunk(ev: StreamEvent | None, usage: Usage | None, index: int = 0) -> dict[str, Any]:
        choices = []
        if ev is not None:
            offset = offsets.get(index, 0)
            logprobs = stream_logprobs(ev.token, ev.text, offset) if req.logprobs is not None else None
            offsets[index] = offset + len(ev.text)
            choices = [CompletionChoice(index=index, text=ev.text, logprobs=logprobs, finish_reason=finish(ev.end))]
        return dump(Completion(id=rid, created=created, model=model_name(state, req), usage=usage,
                               system_fingerprint=state.system_fingerprint, choices=choices))
    return chunk
