"""OpenAI's Responses API: POST /v1/responses, streamed (typed events) or not, stateless or continuing a stored
response through `previous_response_id` (engine.server.response_store).

A request becomes the chat route's pieces: `instructions` a system message, input items chat messages
(`function_call` an assistant turn's tool call, `function_call_output` a `tool` turn), `text.format` the
response_format grammar, function `tools` and `tool_choice` the tool grammar (engine.server.tools). The answer
is a `message` item with `output_text`, or `function_call` items, after a `reasoning` item for a reasoning model's
`<think>` span, which `reasoning.effort` (or `reasoning.max_tokens`) bounds or turns off
(engine.server.reasoning_request). Whatever this server does not do is a 422
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
from engine.server.harmony import analysis_spans
from engine.server.infer import Generation
from engine.server.openai_common import parameters
from engine.server.openai_requests import apply_chat_template, prefetch_images
from engine.server.protocol import GenerateRequest, dump
from engine.server.answer_text import AnswerStream, read_answer
from engine.server.reasoning import END, ReasoningFormat, for_prompt, reasoning_format, split_reasoning
from engine.server.reasoning_request import request_grammar, responses_reasoning
from engine.server.response_store import ResponseStore
from engine.server.responses_protocol import (InputTokensDetails, OutputTokensDetails, ResponseObject, ResponsesRequest,
                                              ResponseUsage)
from engine.server.state import ServerState
from engine.server.streaming import EventStream, admit, stream_error, unless_disconnected
from engine.server.tools import ToolUse, new_call_id, tool_use
from engine.server.validation import ValidRequest, chat_request, parse_body
from engine.structured.tool_calls import ToolCall

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
        thinks = reasoning_format(state.config.reasoning_parser, getattr(state.tokenizer, "chat_template", None))
        chat = chat_request({
            "model": req.model, "messages": system + messages, "temperature": req.temperature, "top_p": req.top_p,
            "seed": req.seed, "tools": _tools(req.tools), "tool_choice": _tool_choice(req.tool_choice),
            "parallel_tool_calls": req.parallel_tool_calls,
            "response_format": _response_format(req.text), **responses_reasoning(req.reasoning, thinks)})
        use = tool_use(chat, state.tokenizer, state.config.tool_call_parser)
        grammar = response_format_grammar(chat.response_format)
        if use is not None and grammar is not None:
            raise ValidationError('`text.format` cannot be combined with `tools` unless `tool_choice` is "none"')
        prompt = apply_chat_template(state, chat, use)
        await prefetch_images(state, prompt, add_special_tokens=False)
        grammar = request_grammar(chat, thinks, use, grammar, prompt, state.tokenizer)     # after the reasoning
        thinks = for_prompt(thinks, prompt)
        await prepare_spec(grammar, state.engine)
        params = parameters(chat, req.max_output_tokens, 0, grammar)
        generate = GenerateRequest(inputs=prompt, parameters=params)
        answer = _Answer(state, req, use, messages, thinks)
        if req.stream:
            return _stream(state, store, answer, generate, arrival)
        with state.infer.permit():
            valid = state.validator.validate(generate, add_special_tokens=False)
            gen, _ = await unless_disconnected(request, state.infer.generate(valid, arrival))
        body = answer.finish(gen)
        answer.remember(store)
        return JSONResponse(dump(body))


# --- request -------------------------------------------------------------------------------------

def _refuse_unsupported(req: ResponsesRequest) -> None:
    for field, what in _REFUSED.items():
        if getattr(req, field):
            raise ValidationError(f"`{field}`: {what} is not supported by this server")


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
                 messages: list[dict[str, Any]], thinks: ReasoningFormat | None):
        self.state, self.req, self.use, self.messages = state, req, use, messages
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.call_ids: list[tuple[str, str]] = []       # (call_id, item id) of each function call
        self.rs_id = f"rs_{uuid.uuid4().hex}"
        self.thinks = thinks
        self.turn: dict[str, Any] | None = None

    def ids(self, index: int) -> tuple[str, str]:
        while len(self.call_ids) <= index:
            self.call_ids.append((new_call_id(self.use.fmt if self.use else None), f"fc_{uuid.uuid4().hex}"))
        return self.call_ids[index]

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

    def call_item(self, index: int, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
        call_id, item_id = self.ids(index)
        return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
                "arguments": arguments, "status": status}

    def finish(self, gen: Generation) -> ResponseObject:
        """The response for `gen` (a stream's calls keep the ids their events carried: one per call index)."""
        answer = read_answer(gen.text, self.use, self.thinks, gen.finish_reason == "length")
        calls = answer.calls
        if calls:
            output = [self.call_item(i, c.name, c.arguments) for i, c in enumerate(calls)]
            if answer.reasoning is not None:
                output.insert(0, self.reasoning_item(answer.reasoning))
            self.turn = {"role": "assistant", "content": "", "tool_calls": [
                {"id": self.ids(i)[0], "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for i, c in enumerate(calls)]}
        else:
            reasoning, text = answer.reasoning, answer.content
            output = [self.message_item(text)]
            if reasoning is not None:
                output.insert(0, self.reasoning_item(reasoning))
            self.turn = {"role": "assistant", "content": text}
        cut = gen.finish_reason == "length"
        usage = ResponseUsage(input_tokens=gen.input_length, output_tokens=gen.generated_tokens,
                              total_tokens=gen.input_length + gen.generated_tokens,
                              input_tokens_details=InputTokensDetails(cached_tokens=gen.num_cached_tokens),
                              output_tokens_details=OutputTokensDetails(
                                  reasoning_tokens=reasoning_tokens(gen, self.thinks)))
        return self.body("incomplete" if cut else "completed", output, usage,
                         {"reason": "max_output_tokens"} if cut else None)

    def remember(self, store: ResponseStore) -> None:
        if self.req.store and self.turn is not None:
            store.put(self.id, self.messages + [self.turn])


def reasoning_tokens(gen: Generation, thinks: ReasoningFormat | None) -> int:
    """`usage.output_tokens_details.reasoning_tokens`: the generated tokens that begin inside the reasoning, its
    markers included (`<think>`…`</think>`, or each harmony analysis message from its header to its end)."""
    if thinks is None:
        return 0
    spans = _reasoning_spans(gen.text, thinks)
    count, at = 0, 0
    for token in gen.tokens:
        count += any(start <= at < end for start, end in spans)
        at += len(token.text)
    return count


def _reasoning_spans(text: str, thinks: ReasoningFormat) -> list[tuple[int, int]]:
    """Where the reasoning is in `text`, as [start, end) character ranges."""
    if split_reasoning(text, thinks)[0] is None:
        return []
    if thinks.name != "gpt_oss":
        end = text.find(END)
        return [(0, len(text) if end < 0 else end + len(END))]
    return analysis_spans(text)


# --- stream --------------------------------------------------------------------------------------

def _stream(state: ServerState, store: ResponseStore, answer: _Answer, generate: GenerateRequest,
            arrival: float) -> EventStream:
    valid, release = admit(state, lambda: state.validator.validate(generate, stream=True, add_special_tokens=False))
    return EventStream(_events(state, store, answer, valid, arrival), on_close=release)


class _Events:
    """Typed events, numbered in order; each output item (a message, or each function call) opened on its first
    piece."""

    def __init__(self, answer: _Answer):
        self.answer = answer
        self.number = 0
        self.item: str | None = None
        self.text = ""
        self.name = ""
        self.arguments = ""
        self.call = -1              # the open function call's index among the answer's calls
        self.at = 0                 # the open item's output_index (1 after a reasoning item, +1 per call)
        self.reasoning = ""

    def event(self, kind: str, **data: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.number, **data}
        self.number += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()

    def piece(self, kind: str, text: str, index: int = 0) -> list[bytes]:
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
            return self.close_reasoning() + self.piece(kind, text, index)
        if kind == "content":
            if not text:
                return []
            out = self.open_message()
            self.text += text
            return out + [self.event("response.output_text.delta", item_id=a.item_id, output_index=self.at,
                                     content_index=0, delta=text, logprobs=[])]
        if kind == "name":
            out = self.close_call(self.arguments) if self.item == "call" else []
            if out:
                self.at += 1
            self.item, self.name, self.arguments, self.call = "call", text, "", index
            return out + [self.event("response.output_item.added", output_index=self.at,
                                     item=a.call_item(index, text, "", "in_progress"))]
        self.arguments += text
        return [self.event("response.function_call_arguments.delta", item_id=a.ids(index)[1], output_index=self.at,
                           delta=text)] if text else []

    def close_call(self, arguments: str) -> list[bytes]:
        a = self.answer
        return [self.event("response.function_call_arguments.done", item_id=a.ids(self.call)[1],
                           output_index=self.at, arguments=arguments),
                self.event("response.output_item.done", output_index=self.at,
                           item=a.call_item(self.call, self.name, arguments))]

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

    def close(self, calls: list[ToolCall]) -> list[bytes]:
        a = self.answer
        if self.item == "call" and calls:
            return self.close_call(calls[-1].arguments)
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
    pieces = AnswerStream(answer.use, answer.thinks)
    try:
        async with contextlib.aclosing(state.infer.stream(valid, arrival)) as stream:
            async for ev in stream:
                for kind, text, index in pieces.feed(ev.text, ev.end):
                    for chunk in events.piece(kind, text, index):
                        yield chunk
                if ev.end is None:
                    continue
                for chunk in events.close(pieces.calls):
                    yield chunk
                body = dump(answer.finish(ev.end))
                answer.remember(store)
                kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
                yield events.event(kind, response=body)
    except Exception as exc:  # noqa: BLE001 - the client gets an error event, not a traceback
        stream_error(state, exc, space=True)        # counted and logged as every stream's failure
        err = exc if isinstance(exc, ServerError) else GenerationError(type(exc).__name__)
        yield events.event("error", code=err.error_type, message=err.body()["error"], param=None)
