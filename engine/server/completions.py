"""/v1/completions: prompts as text or token ids (batched), echo, legacy logprobs, scoring with max_tokens 0,
n and best_of."""
from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.server import choices as fan
from engine.server.grammar import prepare_grammars, response_format_grammar
from engine.server.infer import StreamEvent
from engine.server.legacy_logprobs import stream_logprobs
from engine.server.openai_common import adapter_id, finish, model_name, parameters, stream_choices
from engine.server.openai_requests import (COMPLETIONS_MAX_TOKENS, check_completion, completion_choice,
                                          prefetch_images, validate_prompt)
from engine.server.protocol import Completion, CompletionChoice, CompletionRequest, Usage, dump
from engine.server.state import ServerState
from engine.server.streaming import unless_disconnected
from engine.server.validation import parse_body

async def completions(request: Request) -> Response:
    state: ServerState = request.app.state.server
    with state.request() as arrival:
        body = await request.body()
        await prepare_grammars(body, state.engine)   # before parsing: a huge schema is refused unparsed
        req = parse_body(CompletionRequest, body)
        check_completion(state, req)
        prompts = req.prompts()
        for prompt in prompts:
            if isinstance(prompt, str):
                await prefetch_images(state, prompt)
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
                fan.fan_out(validate_prompt(state, p, params, default, stream=True), n, req.seed, prompt_logprobs=False)
                for p in prompts])
        with state.infer.permit():
            groups = [fan.fan_out(validate_prompt(state, prompt, params, default), best_of, req.seed,
                                  prompt_logprobs=req.echo and req.logprobs is not None) for prompt in prompts]
            gens = await unless_disconnected(request, state.infer.generate_groups(
                groups, arrival, state.config.prefix_caching))
        returned = [fan.best(g, n) for g in gens]
        choices = [completion_choice(state, req, group[0], gen, prompt_gens[0].prefill, i * n + j, scoring)
                   for i, (group, prompt_gens, kept) in enumerate(zip(groups, gens, returned))
                   for j, gen in enumerate(kept)]
        body = Completion(id=rid, created=created, model=model_name(state, req), choices=choices,
                          usage=fan.usage(gens, returned, count_completion=not scoring),
                          system_fingerprint=state.system_fingerprint)
        return JSONResponse(dump(body))


def _chunk_builder(state: ServerState, req: CompletionRequest, rid: str,
                   created: int) -> Callable[..., Completion]:
    offsets: dict[int, int] = {}    # per choice: where the next piece starts in its text

    def chunk(ev: StreamEvent | None, usage: Usage | None, index: int = 0) -> Completion:
        choices = []
        if ev is not None:
            offset = offsets.get(index, 0)
            logprobs = stream_logprobs(ev.token, ev.text, offset) if req.logprobs is not None else None
            offsets[index] = offset + len(ev.text)
            choices = [CompletionChoice(index=index, text=ev.text, logprobs=logprobs, finish_reason=finish(ev.end))]
        return Completion(id=rid, created=created, model=model_name(state, req), usage=usage,
                          system_fingerprint=state.system_fingerprint, choices=choices)
    return chunk
