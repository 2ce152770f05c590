"""One batch input line -> a validated engine request -> one OpenAI Batch output line.

The server's code does the work: the wire models, the chat template, sampling parameters, validation and
the response bodies of /v1/chat/completions and /v1/completions (engine/server/openai_requests.py, which the
routes import too), and of /v1/embeddings (engine/server/pooling_routes.py: embedding_inputs and
embedding_response). What the batch adds: the line's envelope (custom_id, method, url, body), a seed per
custom_id (the same answer whatever the sharding) and error lines instead of HTTP errors. One choice per
request (`n` = 1, one prompt); an embeddings line may have many inputs (one engine request each).
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig
from engine.server import choices as fan
from engine.server.errors import ServerError
from engine.server.grammar import response_format_grammar
from engine.server.infer import Generation
from engine.server.openai_common import check_common, parameters
from engine.server.openai_requests import (COMPLETIONS_MAX_TOKENS, apply_chat_template, chat_choice, check_completion,
                                          completion_choice, validate_prompt)
from engine.server.pooling_protocol import EmbeddingRequest
from engine.server.pooling_routes import embedding_inputs, embedding_response
from engine.server.protocol import (ChatCompletion, ChatCompletionRequest, Completion, CompletionRequest,
                                    GenerateRequest, dump)
from engine.server.tools import ToolUse, tool_use
from engine.server.validation import Limits, ValidRequest, Validator, parse_body

CHAT, COMPLETIONS, EMBEDDINGS = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"
URLS = (CHAT, COMPLETIONS, EMBEDDINGS)
MAX_SEED = 2**63 - 1


class RequestError(Exception):
    """A line that cannot run; it becomes an error line with this code and message."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


@dataclass(slots=True)
class Driven:
    """What ServerState.engine (an AsyncEngine) gives the pooling routes: the engine it drives."""

    engine: Any


@dataclass(slots=True)
class OfflineState:
    """What the server's request code reads from its ServerState, for an engine without a server."""

    tokenizer: Any
    validator: Validator
    config: EngineConfig
    model_name: str
    engine: Driven

    @property
    def system_fingerprint(self) -> str:
        return "tgi-hpc-batch"

    @property
    def task(self) -> str:
        """generate, or the pooling engine's task (embed, classify)."""
        return str(getattr(self.engine.engine, "task", "generate"))

    @classmethod
    def of(cls, llm: Any, config: EngineConfig) -> OfflineState:
        limits = Limits(max_best_of=config.max_best_of, max_stop_sequences=config.max_stop_sequences,
                        max_top_n_tokens=config.max_top_n_tokens, max_input_tokens=llm.max_input_tokens,
                        max_total_tokens=llm.max_total_tokens, max_new_tokens_default=config.max_new_tokens_default,
                        vocab_size=getattr(llm, "vocab_size", None))
        name = config.served_model_name or config.model_id
        validator = Validator(llm.tokenizer, limits, (), name)
        if getattr(getattr(llm, "model_config", None), "image_token_id", None) is not None:
            from engine.server.app import vision_processor   # a vision-language model: image_url parts, as served
            validator.vision = vision_processor(llm.model_config, config)
        return cls(llm.tokenizer, validator, config, name, Driven(llm))


@dataclass(slots=True)
class Prepared:
    custom_id: str
    url: str
    req: ChatCompletionRequest | CompletionRequest | EmbeddingRequest
    valid: ValidRequest | None              # None for embeddings: their inputs are `inputs`
    use: ToolUse | None = None
    scoring: bool = False
    inputs: list[list[int]] | None = None   # the token ids of each input of an embeddings line
    skip: int = 0                           # its leading prompt tokens the pooling leaves out


def seed_of(custom_id: str) -> int:
    """The sampling seed of a request that sets none: from its custom_id, so a rerun or another sharding
    samples the same tokens."""
    return int.from_bytes(hashlib.sha256(custom_id.encode()).digest()[:8], "big") & MAX_SEED


def envelope(text: str) -> tuple[str, dict]:
    """(url, body) of a line: OpenAI's Batch envelope, or a plain chat (`messages`) or completion (`prompt`)."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise RequestError("invalid_json", f"the line is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise RequestError("invalid_request", "the line must be a JSON object")
    if any(key in data for key in ("custom_id", "url", "body", "method")):
        if data.get("method", "POST") != "POST":
            raise RequestError("invalid_request", f"`method` must be POST, got {data.get('method')!r}")
        url = data.get("url")
        if url not in URLS:
            raise RequestError("invalid_url", f"unsupported `url` {url!r}: use {CHAT}, {COMPLETIONS} or {EMBEDDINGS}")
        body = data.get("body")
        if not isinstance(body, dict):
            raise RequestError("missing_body", "`body` (the request, a JSON object) is missing")
        return url, body
    if "messages" in data:
        return CHAT, data
    if "prompt" in data:
        return COMPLETIONS, data
    raise RequestError("invalid_request", "expected an OpenAI Batch line (custom_id, method, url, body) or a "
                                          "plain line with `messages` or `prompt`")


def prepare(state: OfflineState, custom_id: str, text: str) -> Prepared:
    """Validate one line as the server validates a request; RequestError says why not."""
    url, body = envelope(text)
    raw = json.dumps(body).encode()
    _check_task(state, url)
    try:
        if url == EMBEDDINGS:
            req = parse_body(EmbeddingRequest, raw)
            inputs, skip = embedding_inputs(state, req)  # type: ignore[arg-type]
            return Prepared(custom_id, url, req, None, inputs=inputs, skip=skip)
        if url == CHAT:
            return _prepare_chat(state, custom_id, parse_body(ChatCompletionRequest, raw))
        return _prepare_completion(state, custom_id, parse_body(CompletionRequest, raw))
    except ServerError as exc:
        raise RequestError("invalid_request", str(exc)) from None


TASK_OF_URL = {CHAT: "generate", COMPLETIONS: "generate", EMBEDDINGS: "embed"}
KINDS = {"generate": "a text-generation", "embed": "an embedding", "classify": "a cross-encoder / classifier"}


def _check_task(state: OfflineState, url: str) -> None:
    """A line for another kind of model than the batch's (an embeddings line to a chat model, or the reverse)."""
    task = state.task
    if TASK_OF_URL[url] != task:
        serves = " or ".join(u for u, t in TASK_OF_URL.items() if t == task) or "no batch url"
        raise RequestError("invalid_url", f"{url} needs {KINDS[TASK_OF_URL[url]]} model, and {state.model_name!r} "
                                          f"is {KINDS.get(task, 'a ' + task)} model: it serves {serves}")


def _one_choice(req: ChatCompletionRequest | CompletionRequest) -> None:
    if (req.n or 1) != 1 or getattr(req, "best_of", None) not in (None, 1):
        raise RequestError("invalid_request", "`n` and `best_of` must be 1 in a batch (one line per request)")


def _prepare_chat(state: OfflineState, custom_id: str, req: ChatCompletionRequest) -> Prepared:
    check_common(req)
    _one_choice(req)
    use = tool_use(req, state.tokenizer, state.config.tool_call_parser)
    grammar = response_format_grammar(req.response_format)
    if use is not None and grammar is not None:
        raise RequestError("invalid_request", "`response_format` cannot be combined with `tools`")
    top_n = (req.top_logprobs or 0) if req.logprobs else 0
    prompt = apply_chat_template(state, req, use)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = parameters(req, max_tokens, top_n, use.grammar if use is not None else grammar)
    params.seed = req.seed if req.seed is not None else seed_of(custom_id)
    valid = state.validator.validate(GenerateRequest(inputs=prompt, parameters=params), add_special_tokens=False)
    _no_unasked_logprobs(valid, bool(req.logprobs))
    return Prepared(custom_id, CHAT, req, valid, use)


def _prepare_completion(state: OfflineState, custom_id: str, req: CompletionRequest) -> Prepared:
    check_completion(state, req)
    _one_choice(req)
    prompts = req.prompts()
    if len(prompts) != 1:
        raise RequestError("invalid_request", f"one prompt per batch line, got {len(prompts)}")
    scoring = req.max_tokens == 0
    params = parameters(req, 1 if scoring else req.max_tokens, req.logprobs or 0,
                        response_format_grammar(req.response_format))
    params.seed = req.seed if req.seed is not None else seed_of(custom_id)
    default = min(COMPLETIONS_MAX_TOKENS, state.config.max_new_tokens_default or COMPLETIONS_MAX_TOKENS)
    valid = validate_prompt(state, prompts[0], params, default)
    _no_unasked_logprobs(valid, req.logprobs is not None)
    return Prepared(custom_id, COMPLETIONS, req, valid, scoring=scoring)


def _no_unasked_logprobs(valid: ValidRequest, asked: bool) -> None:
    """A line that asks for no logprobs gets none from the engine either. The server keeps TGI's logprob per
    token (its /generate details report them); a batch line's output never shows them, and without them a greedy
    step skips the sampler's vocabulary-wide log_softmax (docs/benchmarks.md, batch vs serve)."""
    if not asked:
        valid.params.logprobs = False


def _line_id(custom_id: str) -> str:
    return hashlib.sha256(custom_id.encode()).hexdigest()[:24]


def response_line(state: OfflineState, prep: Prepared, gen: Generation) -> str:
    rid, created, model = _line_id(prep.custom_id), int(time.time()), prep.req.model or state.model_name
    body: Any
    if prep.url == CHAT:
        choice = chat_choice(gen, prep.use, bool(prep.req.logprobs), 0)  # type: ignore[union-attr]
        body = ChatCompletion(id=f"chatcmpl-{rid}", created=created, model=model, choices=[choice],
                              usage=fan.usage([[gen]], [[gen]]), system_fingerprint=state.system_fingerprint)
    else:
        choice = completion_choice(state, prep.req, prep.valid, gen, gen.prefill, 0,  # type: ignore[arg-type]
                                    prep.scoring)
        body = Completion(id=f"cmpl-{rid}", created=created, model=model, choices=[choice],
                          usage=fan.usage([[gen]], [[gen]], count_completion=not prep.scoring),
                          system_fingerprint=state.system_fingerprint)
    return _ok_line(prep.custom_id, rid, body)


def embedding_line(state: OfflineState, prep: Prepared, rows: list[Any]) -> str:
    """The output line of an embeddings line, from the pooled row of each of its inputs, in order."""
    import torch

    body = embedding_response(state, prep.req, torch.stack(rows), prep.inputs or [])  # type: ignore[arg-type]
    rid = _line_id(prep.custom_id)
    body.id = f"embd-{rid}"
    return _ok_line(prep.custom_id, rid, body)


def _ok_line(custom_id: str, rid: str, body: Any) -> str:
    return json.dumps({"id": f"batch_req_{rid}", "custom_id": custom_id,
                       "response": {"status_code": 200, "request_id": rid, "body": dump(body)}, "error": None})


def error_line(custom_id: str, code: str, message: str, line_no: int | None = None) -> str:
    error: dict[str, Any] = {"code": code, "message": message}
    if line_no is not None:
        error["line"] = line_no
    return json.dumps({"id": f"batch_req_{_line_id(custom_id)}", "custom_id": custom_id, "response": None,
                       "error": error})
