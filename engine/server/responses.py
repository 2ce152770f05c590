"""OpenAI's Responses API: POST /v1/responses, streamed (typed events) or not, stateless or continuing a stored
response through `previous_response_id` (engine.server.response_store).

A request becomes the chat route's pieces: `instructions` a system message, input items chat messages
(`function_call` an assistant turn's tool call, `function_call_output` a `tool` turn), `text.format` the
response_format grammar, function `tools` and `tool_choice` the tool grammar (engine.server.tools). The answer
is a `message` item with `output_text` (after a `reasoning` item for a reasoning model's `<think>` span), or a
`function_call` item. Whatever this server does not do is a 422
naming the field: built-in tools, image and file inputs, background mode, conversations, prompt templates.
"""
from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.server.errors import GenerationError, ServerError, ValidationError
from engine.server.grammar import prepare_spec, response_format_grammar
from engine.server.infer import Generation
from engine.server.openai_common import parameters
from engine.server.openai_requests import apply_chat_template
from engine.server.protocol import GenerateRequest, dump
from engine.server.reasoning import ReasoningStream, reasoning_format, split_reasoning
from engine.server.response_store import ResponseStore
from engine.server.responses_protocol import InputTokensDetails, ResponseObject, ResponsesRequest, ResponseUsage
from engine.server.state import ServerState
from engine.server.streaming import EventStream, admit, stream_error, unless_disconnected
from engine.server.tools import ToolUse, new_call_id, tool_use
from engine.server.validation import ValidRequest, chat_request, parse_body
from engine.structured.tool_calls import ToolCall, ToolCallStream, parse_tool_call

_REFUSED = {"background": "background mode", "conversation": "conversations", "prompt": "prompt templates",
            "top_logprobs": "logprobs", "max_tool_calls": "`max_tool_calls`"}
_TEXT_PARTS = ("input_text", "output_text", "text")


async def create_response(request: Request) -> Response:
    state: ServerState = request.app.state.server
    store: ResponseStore = request.app.state.responses
    with state.request() as arrival:
        req = parse_body(ResponsesRequest, await request.body())
        _refuse_unsupported(req)
        history = _history(store, req)
        messages = history + _input_messages(req.input)
        if not messages:
            raise ValidationError("`input` must hold at least one item")
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        chat = chat_request({
            "model": req.model, "messages": system + messages, "temperature": req.temperature, "top_p": req.top_p,
            "seed": req.seed, "tools": _tools(req.tools), "tool_choice": _tool_choice(req.tool_choice),
            "response_format": _response_format(req.text)})
        use = tool_use(chat, state.tokenizer)
        grammar = response_format_grammar(chat.response_format)
        if use is not None and grammar is not None:
            raise ValidationError('`text.format` cannot be combined with `tools` unless `tool_choice` is "none"')
        prompt = apply_chat_template(state, chat, use)
        await prepare_spec(use.grammar if use is not None else grammar, state.engine)
        params = parameters(chat, req.max_output_tokens, 0, use.grammar if use is not None else grammar)
        generate = GenerateRequest(inputs=prompt, parameters=params)
        answer = _Answer(state, req, use, messages)
        if req.stream:
            return _stream(state, store, answer, generate, arrival)
        with state.infer.permit():
            valid = state.validator.validate(generate, add_special_tokens=False)
            gen, _ = await unless_disconnected(request, state.infer.generate(valid, arrival))
        body = answer.finish(gen, answer.call_of(gen))
        answer.remember(store)
        return JSONResponse(dump(body))


# --- request -------------------------------------------------------------------------------------

def _refuse_unsupported(req: ResponsesRequest) -> None:
    for field, what in _REFUSED.items():
        if getattr(req, field):
            raise ValidationError(f"`{field}`: {what} is not supported by this server")
    if req.reasoning and req.reasoning.get("effort") not in (None, "none", "minimal"):
        raise ValidationError("`reasoning` is not supported by this server (it has no reasoning parser)")


def _history(store: ResponseStore, req: ResponsesRequest) -> list[dict[str, Any]]:
    if req.previous_response_id is None:
        return []
    messages = store.get(req.previous_response_id)
    if messages is None:
        raise ValidationError(f"`previous_response_id` {req.previous_response_id!r} is not a response this server "
                              f"has stored (it keeps the last {store.max_entries}, in memory, when `store` is true)")
    return messages


def _input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ValidationError(f'`{where}.role` must be "user", "assistant", "system" or "developer"')
            out.append({"role": "system" if role == "developer" else role,
                        "content": _content_text(item.get("content"), where)})
        elif kind == "function_call":
            name, arguments, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
            if not all(isinstance(v, str) and v for v in (name, arguments, call_id)):
                raise ValidationError(f"`{where}` needs `name`, `arguments` and `call_id` strings")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            if out and out[-1]["role"] == "assistant" and not out[-1].get("tool_calls"):
                out[-1]["tool_calls"] = [call]
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or not call_id:
                raise ValidationError(f"`{where}.call_id` is required")
            out.append({"role": "tool", "tool_call_id": call_id, "content": _content_text(output, f"{where}.output")})
        elif kind == "reasoning":
            continue        # earlier reasoning is not shown to the model again
        else:
            raise ValidationError(f"`{where}.type` {kind!r} is not supported by this server: it takes messages, "
                                  "function_call and function_call_output items")
    return out


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValidationError(f"`{where}.content` must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ValidationError(f"`{where}.content[{j}].type` {kind!r} is not supported by this server: "
                                  "only text parts (input_text, output_text)")
        texts.append(part["text"])
    return "".join(texts)


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise ValidationError(f"`tools[{i}].type` {tool.get('type')!r}: built-in tools are not supported by this "
                                  "server, only function tools")
        out.append({"type": "function", "function": {"name": tool.get("name"),
                                                     "description": tool.get("description") or "",
                                                     "parameters": tool.get("parameters")}})
    return out


def _tool_choice(choice: str | dict[str, Any] | None) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ValidationError('`tool_choice` must be "none", "auto", "required" or {"type": "function", "name": ...}')


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise ValidationError('`text.format` must be {"type": "text" | "json_object" | "json_schema", ...}')
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema"),
                                                       "strict": fmt.get("strict")}}
    return {"type": fmt.get("type")}


# --- answer --------------------------------------------------------------------------------------

class _Answer:
    """The response being built: its ids, its output items, and the conversation it continues."""

    def __init__(self, state: ServerState, req: ResponsesRequest, use: ToolUse | None,
                 messages: list[dict[str, Any]]):
        self.state, self.req, self.use, self.messages = state, req, use, messages
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.call_id, self.fc_id = new_call_id(), f"fc_{uuid.uuid4().hex}"
        self.rs_id = f"rs_{uuid.uuid4().hex}"
        self.thinks = reasoning_format(state.config.reasoning_parser, getattr(state.tokenizer, "chat_template", None)) \
            if use is None else None
        self.turn: dict[str, Any] | None = None

    def call_of(self, gen: Generation) -> ToolCall | None:
        return parse_tool_call(gen.text, self.use.fmt, self.use.tools) if self.use is not None else None

    def body(self, status: str, output: list[dict[str, Any]], usage: ResponseUsage | None = None,
             incomplete: dict[str, str] | None = None) -> ResponseObject:
        req = self.req
        return ResponseObject(
            id=self.id, created_at=self.created, status=status, model=req.model or self.state.model_name,
            output=output, instructions=req.instructions, previous_response_id=req.previous_response_id,
            incomplete_details=incomplete, tools=req.tools or [],
            tool_choice=req.tool_choice if req.tool_choice is not None else "auto",
            parallel_tool_calls=bool(req.parallel_tool_calls), text=req.text or {"format": {"type": "text"}},
            temperature=req.temperature, top_p=req.top_p, max_output_tokens=req.max_output_tokens,
            metadata=req.metadata or {}, store=req.store, usage=usage)

    def message_item(self, text: str, status: str = "completed") -> dict[str, Any]:
        done = status != "in_progress"
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if done else []
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant", "content": content}

    def reasoning_item(self, text: str, status: str = "completed") -> dict[str, Any]:
        return {"type": "reasoning", "id": self.rs_id, "summary": [], "status": status,
                "content": [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []}

    def call_item(self, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
        return {"type": "function_call", "id": self.fc_id, "call_id": self.call_id, "name": name,
                "arguments": arguments, "status": status}

    def finish(self, gen: Generation, call: ToolCall | None) -> ResponseObject:
        if call is not None:
            output = [self.call_item(call.name, call.arguments)]
            self.turn = {"role": "assistant", "content": "", "tool_calls": [
                {"id": self.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]}
        else:
            reasoning, text = split_reasoning(gen.text, self.thinks) if self.thinks is not None else (None, gen.text)
            output = [self.message_item(text)]
            if reasoning is not None:
                output.insert(0, self.reasoning_item(reasoning))
            self.turn = {"role": "assistant", "content": text}
        cut = gen.finish_reason == "length" and call is None
        usage = ResponseUsage(input_tokens=gen.input_length, output_tokens=gen.generated_tokens,
                              total_tokens=gen.input_length + gen.generated_tokens,
                              input_tokens_details=InputTokensDetails(cached_tokens=gen.num_cached_tokens))
        return self.body("incomplete" if cut else "completed", output, usage,
                         {"reason": "max_output_tokens"} if cut else None)

    def remember(self, store: ResponseStore) -> None:
        if self.req.store and self.turn is not None:
            store.put(self.id, self.messages + [self.turn])


# --- stream --------------------------------------------------------------------------------------

def _stream(state: ServerState, store: ResponseStore, answer: _Answer, generate: GenerateRequest,
            arrival: float) -> EventStream:
    valid, release = admit(state, lambda: state.validator.validate(generate, stream=True, add_special_tokens=False))
    return EventStream(_events(state, store, answer, valid, arrival), on_close=release)


class _Events:
    """Typed events, numbered in order; one output item (a message, or a function call) opened on its first
    piece."""

    def __init__(self, answer: _Answer):
        self.answer = answer
        self.number = 0
        self.item: str | None = None
        self.text = ""
        self.name = ""
        self.arguments = ""
        self.at = 0                 # the open item's output_index (1 after a reasoning item)
        self.reasoning = ""

    def event(self, kind: str, **data: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.number, **data}
        self.number += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()

    def piece(self, kind: str, text: str) -> list[bytes]:
        a = self.answer
        if kind == "reasoning":
            if not text:
                return []
            out = [] if self.item == "reasoning" else [
                self.event("response.output_item.added", output_index=0, item=a.reasoning_item("", "in_progress"))]
            self.item = "reasoning"
            self.reasoning += text
            return out + [self.event("response.reasoning_text.delta", item_id=a.rs_id, output_index=0,
                                     content_index=0, delta=text)]
        if self.item == "reasoning":
            return self.close_reasoning() + self.piece(kind, text)
        if kind == "content":
            if not text:
                return []
            out = self.open_message()
            self.text += text
            return out + [self.event("response.output_text.delta", item_id=a.item_id, output_index=self.at,
                                     content_index=0, delta=text, logprobs=[])]
        if kind == "name":
            self.item, self.name = "call", text
            return [self.event("response.output_item.added", output_index=self.at,
                               item=a.call_item(text, "", "in_progress"))]
        self.arguments += text
        return [self.event("response.function_call_arguments.delta", item_id=a.fc_id, output_index=self.at,
                           delta=text)] if text else []

    def close_reasoning(self) -> list[bytes]:
        a, self.item, self.at = self.answer, None, 1
        return [self.event("response.reasoning_text.done", item_id=a.rs_id, output_index=0, content_index=0,
                           text=self.reasoning),
                self.event("response.output_item.done", output_index=0, item=a.reasoning_item(self.reasoning))]

    def open_message(self) -> list[bytes]:
        if self.item == "reasoning":
            return self.close_reasoning() + self.open_message()
        if self.item == "message":
            return []
        self.item = "message"
        a = self.answer
        return [self.event("response.output_item.added", output_index=self.at, item=a.message_item("", "in_progress")),
                self.event("response.content_part.added", item_id=a.item_id, output_index=self.at, content_index=0,
                           part={"type": "output_text", "text": "", "annotations": []})]

    def close(self, call: ToolCall | None) -> list[bytes]:
        a = self.answer
        if self.item == "call" and call is not None:
            return [self.event("response.function_call_arguments.done", item_id=a.fc_id, output_index=self.at,
                               arguments=call.arguments),
                    self.event("response.output_item.done", output_index=self.at,
                               item=a.call_item(call.name, call.arguments))]
        out = self.open_message()       # (an empty answer opens it here)
        part = {"type": "output_text", "text": self.text, "annotations": []}
        return out + [
            self.event("response.output_text.done", item_id=a.item_id, output_index=self.at, content_index=0,
                       text=self.text, logprobs=[]),
            self.event("response.content_part.done", item_id=a.item_id, output_index=self.at, content_index=0,
                       part=part),
            self.event("response.output_item.done", output_index=self.at, item=a.message_item(self.text))]


async def _events(state: ServerState, store: ResponseStore, answer: _Answer, valid: ValidRequest,
                  arrival: float) -> AsyncIterator[bytes]:
    events = _Events(answer)
    created = dump(answer.body("in_progress", []))
    yield events.event("response.created", response=created)
    yield events.event("response.in_progress", response=created)
    use = answer.use
    pieces = ToolCallStream(use.fmt, use.tools, use.allow_text) if use is not None else None
    reasoning = ReasoningStream(answer.thinks) if answer.thinks is not None else None
    try:
        async with contextlib.aclosing(state.infer.stream(valid, arrival)) as stream:
            async for ev in stream:
                if pieces is not None:
                    parts = pieces.feed(ev.text)
                elif reasoning is not None:
                    parts = reasoning.feed(ev.text) + (reasoning.finish() if ev.end is not None else [])
                else:
                    parts = [("content", ev.text)]
                for kind, text in parts:
                    for chunk in events.piece(kind, text):
                        yield chunk
                if ev.end is None:
                    continue
                call = None
                if pieces is not None:
                    last, call = pieces.finish(ev.end.text)
                    for kind, text in last:
                        for chunk in events.piece(kind, text):
                            yield chunk
                for chunk in events.close(call):
                    yield chunk
                body = dump(answer.finish(ev.end, call))
                answer.remember(store)
                kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
                yield events.event(kind, response=body)
    except Exception as exc:  # noqa: BLE001 - the client gets an error event, not a traceback
        stream_error(state, exc, space=True)        # counted and logged as every stream's failure
        err = exc if isinstance(exc, ServerError) else GenerationError(type(exc).__name__)
        yield events.event("error", code=err.error_type, message=err.body()["error"], param=None)
