"""Anthropic's Messages API: POST /v1/messages (streamed or not) and /v1/messages/count_tokens.

A request becomes the chat route's pieces: its `system`, content blocks, `tool_use` and `tool_result` turn into
chat messages for the model's template, its `tools` and `tool_choice` into the same tool grammar
(engine.server.tools), `stop_sequences` into stop sequences. The answer comes back as content blocks (`text`,
`tool_use` with its `input` object) with Anthropic's stop reasons, and a stream as Anthropic's typed events
(message_start, content_block_start, content_block_delta, content_block_stop, message_delta, message_stop). A
reasoning model's `<think>` span (engine.server.reasoning) comes back as a `thinking` block before the text or
the tool calls; `thinking.budget_tokens` bounds it and `{"type": "disabled"}` turns it off
(engine.server.reasoning_request).

Errors use Anthropic's body, `{"type": "error", "error": {"type", "message"}}`, which its clients read, with the
server's usual status codes (422 for a refused request); a stream that fails once open ends with an `error` event.
"""
from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.server.anthropic_protocol import (AnthropicErrorDetail, AnthropicErrorResponse, AnthropicUsage,
                                              ContentBlocks, CountTokensRequest, CountTokensResponse,
                                              MessagesRequest, MessagesResponse)
from engine.server.errors import GenerationError, ServerError, ValidationError
from engine.server.grammar import prepare_spec
from engine.server.infer import Generation
from engine.server.openai_common import parameters
from engine.server.openai_requests import apply_chat_template, prefetch_images
from engine.server.protocol import ChatCompletionRequest, GenerateRequest, dump
from engine.server.answer_text import AnswerStream, read_answer
from engine.server.reasoning import ReasoningFormat, for_prompt, reasoning_format
from engine.server.reasoning_request import anthropic_thinking, request_grammar
from engine.server.state import ServerState
from engine.server.streaming import EventStream, admit, stream_error, unless_disconnected
from engine.server.tools import ToolUse, tool_use
from engine.server.validation import ValidRequest, chat_request, parse_body
from engine.structured.tool_calls import ToolCall

_ERROR_TYPES = {422: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                429: "rate_limit_error", 424: "api_error", 500: "api_error", 503: "overloaded_error"}
_STOP_REASONS = {"length": "max_tokens", "stop_sequence": "stop_sequence"}


async def messages(request: Request) -> Response:
    state: ServerState = request.app.state.server
    try:
        with state.request() as arrival:
            req = parse_body(MessagesRequest, await request.body())
            chat, use = _chat_request(req, state)
            prompt = apply_chat_template(state, chat, use)
            await prefetch_images(state, prompt, add_special_tokens=False)
            grammar = request_grammar(chat, _thinks(state), use, None, prompt, state.tokenizer)   # after the thinking
            thinks = for_prompt(_thinks(state), prompt)
            await prepare_spec(grammar, state.engine)
            params = parameters(chat, req.max_tokens, 0, grammar)
            params.top_k = req.top_k or None
            generate = GenerateRequest(inputs=prompt, parameters=params)
            if req.stream:
                return _stream(state, req, use, thinks, generate, arrival)
            with state.infer.permit():
                valid = state.validator.validate(generate, add_special_tokens=False)
                gen, _ = await unless_disconnected(request, state.infer.generate(valid, arrival))
            return JSONResponse(dump(_response(state, req, use, thinks, gen)))
    except ServerError as exc:
        return error_response(exc)


async def count_tokens(request: Request) -> Response:
    state: ServerState = request.app.state.server
    try:
        req = parse_body(CountTokensRequest, await request.body())
        chat, use = _chat_request(req, state)
        prompt = apply_chat_template(state, chat, use)
        vision = state.validator.vision
        if vision is not None and vision.has_images(prompt):  # the images' tokens, as the processor expands them
            await prefetch_images(state, prompt, add_special_tokens=False)
            ids = state.validator.validate(GenerateRequest(inputs=prompt), add_special_tokens=False).prompt_token_ids
        else:
            ids = state.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        return JSONResponse(dump(CountTokensResponse(input_tokens=len(ids))))
    except ServerError as exc:
        return error_response(exc)


def error_response(exc: ServerError) -> JSONResponse:
    return JSONResponse(dump(_error_body(exc)), status_code=exc.status_code)


def _error_body(exc: ServerError) -> AnthropicErrorResponse:
    kind = _ERROR_TYPES.get(exc.status_code, "api_error")
    return AnthropicErrorResponse(error=AnthropicErrorDetail(type=kind, message=exc.body()["error"]))


# --- request -> chat request ---------------------------------------------------------------------

def _chat_request(req: CountTokensRequest, state: ServerState) -> tuple[ChatCompletionRequest, ToolUse | None]:
    thinking = anthropic_thinking(req.thinking, _thinks(state))
    messages: list[dict[str, Any]] = []
    system = _system_text(req.system)
    if system:
        messages.append({"role": "system", "content": system})
    for i, message in enumerate(req.messages):
        messages += _turn(message.role, message.content, i)
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                               "parameters": t.input_schema}} for t in req.tools or []]
    body: dict[str, Any] = {"messages": messages, "tools": tools or None, "tool_choice": _tool_choice(req),
                            "parallel_tool_calls": not (req.tool_choice or {}).get("disable_parallel_tool_use"),
                            **thinking}
    if isinstance(req, MessagesRequest):
        body.update(model=req.model, temperature=req.temperature, top_p=req.top_p, stop=req.stop_sequences)
    chat = chat_request(body)
    return chat, tool_use(chat, state.tokenizer, state.config.tool_call_parser)


def _system_text(system: str | ContentBlocks | None) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    return "\n".join(_text_of(block, f"system[{j}]") for j, block in enumerate(system))


def _text_of(block: Any, where: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
        raise ValidationError(f'`{where}` must be a text block {{"type": "text", "text": ...}}')
    return block["text"]


def _turn(role: str, content: str | ContentBlocks, i: int) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: text (and tool calls) of the turn; tool results as `tool` turns."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    texts: list[str] = []
    parts: list[dict[str, Any]] = []   # text and image_url parts, in order, when the turn has images
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        where = f"messages[{i}].content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(_text_of(block, where))
            parts.append({"type": "text", "text": texts[-1]})
        elif kind == "image" and role == "user":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block, where)}})
        elif kind == "tool_use" and role == "assistant":
            calls.append(_past_call(block, where))
        elif kind == "tool_result" and role == "user":
            results.append(_tool_result(block, where))
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue        # earlier reasoning is not shown to the model again
        else:
            raise ValidationError(f"`{where}.type` {kind!r} is not supported in a {role} message: this server "
                                  "takes text, image (user), tool_use (assistant) and tool_result (user) blocks")
    turn: list[dict[str, Any]] = list(results)
    if len(parts) > len(texts):  # images: the chat route loads them (or refuses them on a text-only model)
        turn.append({"role": role, "content": parts})
    elif texts or calls:
        message: dict[str, Any] = {"role": role, "content": "".join(texts)}
        if calls:
            message["tool_calls"] = calls
        turn.append(message)
    return turn


def _image_url(block: dict[str, Any], where: str) -> str:
    """An image block's source as a URL: base64 data becomes a data: URL, a url source stays as it is."""
    source = block.get("source")
    if isinstance(source, dict) and source.get("type") == "base64" and isinstance(source.get("data"), str) \
            and isinstance(source.get("media_type"), str):
        return f"data:{source['media_type']};base64,{source['data']}"
    if isinstance(source, dict) and source.get("type") == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise ValidationError(f"`{where}.source` must be {{\"type\": \"base64\", \"media_type\", \"data\"}} or "
                          f"{{\"type\": \"url\", \"url\"}}")


def _past_call(block: dict[str, Any], where: str) -> dict[str, Any]:
    name, arguments = block.get("name"), block.get("input", {})
    if not isinstance(name, str) or not name:
        raise ValidationError(f"`{where}.name` is required")
    if not isinstance(arguments, dict):
        raise ValidationError(f"`{where}.input` must be an object")
    return {"id": str(block.get("id") or ""), "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}


def _tool_result(block: dict[str, Any], where: str) -> dict[str, Any]:
    call_id, content = block.get("tool_use_id"), block.get("content", "")
    if not isinstance(call_id, str) or not call_id:
        raise ValidationError(f"`{where}.tool_use_id` is required")
    if isinstance(content, list):
        content = "\n".join(_text_of(b, f"{where}.content[{k}]") for k, b in enumerate(content))
    elif not isinstance(content, str):
        raise ValidationError(f"`{where}.content` must be a string or a list of text blocks")
    if block.get("is_error"):
        content = f"Error: {content}"
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def _tool_choice(req: CountTokensRequest) -> Any:
    choice = req.tool_choice
    if choice is None:
        return None
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ValidationError('`tool_choice` must be {"type": "auto" | "any" | "none"} or {"type": "tool", "name": ...}')


def _thinks(state: ServerState) -> ReasoningFormat | None:
    return reasoning_format(state.config.reasoning_parser, getattr(state.tokenizer, "chat_template", None))


# --- answer --------------------------------------------------------------------------------------

def _response(state: ServerState, req: MessagesRequest, use: ToolUse | None, thinks: ReasoningFormat | None,
              gen: Generation) -> MessagesResponse:
    answer = read_answer(gen.text, use, thinks, gen.finish_reason == "length")
    content = [_tool_block(call) for call in answer.calls] or [{"type": "text", "text": answer.content}]
    if answer.reasoning is not None:
        content.insert(0, {"type": "thinking", "thinking": answer.reasoning, "signature": ""})
    reason, sequence = _stop(gen, req, bool(answer.calls))
    return MessagesResponse(id=_message_id(), model=req.model or state.model_name, content=content,
                            stop_reason=reason, stop_sequence=sequence,
                            usage=AnthropicUsage(input_tokens=gen.input_length, output_tokens=gen.generated_tokens))


def _tool_block(call: ToolCall, block_id: str | None = None) -> dict[str, Any]:
    return {"type": "tool_use", "id": block_id or _tool_id(), "name": call.name, "input": json.loads(call.arguments)}


def _stop(gen: Generation, req: MessagesRequest, called: bool) -> tuple[str, str | None]:
    if called and gen.finish_reason != "length":
        return "tool_use", None
    reason = _STOP_REASONS.get(gen.finish_reason, "end_turn")
    if reason != "stop_sequence":
        return reason, None
    matched = [s for s in req.stop_sequences or [] if gen.stop_text.startswith(s)]
    return reason, max(matched, key=len) if matched else None


def _message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def _tool_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


# --- stream --------------------------------------------------------------------------------------

def _stream(state: ServerState, req: MessagesRequest, use: ToolUse | None, thinks: ReasoningFormat | None,
            generate: GenerateRequest, arrival: float) -> EventStream:
    """Admitted and validated now (a real 429/422), then Anthropic's events; a failure is the last event."""
    valid, release = admit(state, lambda: state.validator.validate(generate, stream=True, add_special_tokens=False))
    return EventStream(_events(state, req, use, thinks, valid, arrival), on_close=release)


def _event(data: dict[str, Any]) -> bytes:
    return f"event: {data['type']}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()


class _Blocks:
    """The stream's content blocks: a text block, or a tool_use block, opened on their first piece."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None

    def start(self, block: dict[str, Any]) -> list[bytes]:
        out = self.stop()
        self.index += 1
        self.open = block["type"]
        return out + [_event({"type": "content_block_start", "index": self.index, "content_block": block})]

    def text(self, text: str) -> list[bytes]:
        if not text:
            return []
        out = [] if self.open == "text" else self.start({"type": "text", "text": ""})
        return out + [_event({"type": "content_block_delta", "index": self.index,
                              "delta": {"type": "text_delta", "text": text}})]

    def thinking(self, text: str) -> list[bytes]:
        if not text:
            return []
        out = [] if self.open == "thinking" else self.start({"type": "thinking", "thinking": "", "signature": ""})
        return out + [_event({"type": "content_block_delta", "index": self.index,
                              "delta": {"type": "thinking_delta", "thinking": text}})]

    def json(self, text: str) -> list[bytes]:
        return [_event({"type": "content_block_delta", "index": self.index,
                        "delta": {"type": "input_json_delta", "partial_json": text}})] if text else []

    def stop(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [_event({"type": "content_block_stop", "index": self.index})]


async def _events(state: ServerState, req: MessagesRequest, use: ToolUse | None, thinks: ReasoningFormat | None,
                  valid: ValidRequest, arrival: float) -> AsyncIterator[bytes]:
    message = {"id": _message_id(), "type": "message", "role": "assistant", "model": req.model or state.model_name,
               "content": [], "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": valid.input_length, "output_tokens": 0}}
    yield _event({"type": "message_start", "message": message})
    pieces = AnswerStream(use, thinks)
    blocks = _Blocks()
    try:
        async with contextlib.aclosing(state.infer.stream(valid, arrival)) as events:
            async for ev in events:
                for kind, text, _ in pieces.feed(ev.text, ev.end):
                    for chunk in _piece(blocks, kind, text):
                        yield chunk
                if ev.end is None:
                    continue
                for chunk in blocks.stop():
                    yield chunk
                reason, sequence = _stop(ev.end, req, bool(pieces.calls))
                yield _event({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                              "usage": {"output_tokens": ev.end.generated_tokens}})
                yield _event({"type": "message_stop"})
    except Exception as exc:  # noqa: BLE001 - the client gets an error event, not a traceback
        stream_error(state, exc, space=True)        # counted and logged as every stream's failure
        err = exc if isinstance(exc, ServerError) else GenerationError(type(exc).__name__)
        yield _event(dump(_error_body(err)))


def _piece(blocks: _Blocks, kind: str, text: str) -> list[bytes]:
    if kind == "content":
        return blocks.text(text)
    if kind == "reasoning":
        return blocks.thinking(text)
    if kind == "name":
        return blocks.start({"type": "tool_use", "id": _tool_id(), "name": text, "input": {}})
    return blocks.json(text)
