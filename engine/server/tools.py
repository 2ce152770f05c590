"""OpenAI tool calling on the chat route: `tools` and `tool_choice` checked (422 naming the field), the chat
messages and tools handed to the template, and the generated call read back (engine.structured.tool_calls
owns the formats and grammars)."""
from __future__ import annotations

import hashlib
import json
import re
import secrets
import string
import uuid
from dataclasses import dataclass
from typing import Any

from engine.server.errors import ValidationError
from engine.server.protocol import ChatCompletionRequest, ChatMessage
from engine.structured.spec import GrammarError, GrammarSpec, json_schema_spec
from engine.structured.tool_calls import (Tool, ToolCall, ToolCallFormat, calls_text, describe_tools, detect_format,
                                          tool_call_grammar)

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")     # OpenAI's rule for function names
_NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(slots=True)
class ToolUse:
    """Tools the model may (`auto`) or must (`required`, named) call this turn, in `fmt`, under `grammar`: one
    call, or several (`parallel_tool_calls`; by default only with a template that knows tools)."""

    tools: list[Tool]
    fmt: ToolCallFormat
    allow_text: bool
    grammar: GrammarSpec | None     # None: harmony under `auto` with no reasoning budget (free messages)


def tool_use(req: ChatCompletionRequest, tokenizer: Any, parser: str = "auto") -> ToolUse | None:
    """None when the turn cannot call a tool (no tools, or tool_choice "none"). `parser` is --tool-call-parser."""
    if not req.tools:
        if req.tool_choice not in (None, "none"):
            raise ValidationError("`tool_choice` is set but `tools` is empty")
        return None
    tools = [_tool(t, i) for i, t in enumerate(req.tools)]
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise ValidationError(f"`tools` has two functions with the same name: {names}")
    choice = "auto" if req.tool_choice is None else req.tool_choice
    if choice == "none":
        return None
    if choice not in ("auto", "required"):
        tools = [_named(choice, tools)]
    fmt = detect_format(getattr(tokenizer, "chat_template", None), parser)
    try:
        if fmt.name == "harmony":
            from engine.server.harmony import call_grammar
            budget = req.max_reasoning_tokens      # under `auto` without one, the model writes its messages freely
            grammar = None if choice == "auto" and budget is None else \
                call_grammar(tools, tokenizer, budget=budget, allow_text=choice == "auto")
        else:
            grammar = tool_call_grammar(tools, fmt, allow_text=choice == "auto", tokenizer=tokenizer,
                                        parallel=_parallel(req, fmt))
    except GrammarError as exc:
        raise ValidationError(f"`tools` cannot be turned into a grammar: {exc}") from None
    return ToolUse(tools, fmt, choice == "auto", grammar)


def _parallel(req: ChatCompletionRequest, fmt: ToolCallFormat) -> bool:
    """Several calls per turn: OpenAI's default, except for a model whose template knows no tool format (json),
    which gets one unless the request asks (SmolLM2 left free wrote call after call up to max_tokens)."""
    if req.parallel_tool_calls is not None:
        return req.parallel_tool_calls
    return fmt.parallel_by_default


def _tool(item: Any, i: int) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(item, dict) or item.get("type", "function") != "function":
        raise ValidationError(f'`{where}` must be {{"type": "function", "function": {{"name": ...}}}}')
    function = item.get("function")
    if not isinstance(function, dict):
        raise ValidationError(f"`{where}.function` is required")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise ValidationError(f"`{where}.function.name` is required")
    if not _NAME.match(name):
        raise ValidationError(f"`{where}.function.name` must be 1-64 letters, digits, _ or -. Given: {name!r}")
    parameters = function.get("parameters") or _NO_PARAMETERS
    try:
        json_schema_spec(parameters, f"{where}.function.parameters")
    except GrammarError as exc:
        raise ValidationError(str(exc)) from None
    return Tool(name, str(function.get("description") or ""), parameters)


def _named(choice: Any, tools: list[Tool]) -> Tool:
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str):
        raise ValidationError('`tool_choice` must be "none", "auto", "required" or '
                              '{"type": "function", "function": {"name": ...}}')
    for tool in tools:
        if tool.name == name:
            return tool
    raise ValidationError(f"`tool_choice.function.name` {name!r} is not in `tools`")


def template_inputs(req: ChatCompletionRequest, tokenizer: Any, use: ToolUse | None,
                    parser: str = "auto") -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for apply_chat_template. A template that knows tools gets them, and earlier calls as
    `tool_calls` with dict arguments (what HF templates expect); one that does not gets a system message that
    describes them, and earlier calls as the text the model wrote. Llama 3.x templates take one call per assistant
    turn (they raise on more), so parallel calls become consecutive turns; Mistral's take 9-character alphanumeric
    call ids, so other ids are mapped onto such ones (the same id, the same mapping)."""
    fmt = use.fmt if use else detect_format(getattr(tokenizer, "chat_template", None), parser)
    messages = [turn for i, m in enumerate(req.messages) for turn in _message(m, i, fmt)]
    if use is None:
        return messages, None
    if not fmt.describe_in_prompt:
        return messages, [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                            "parameters": t.parameters}} for t in use.tools]
    text = describe_tools(use.tools, fmt, required=not use.allow_text)
    if messages and messages[0]["role"] == "system":
        messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}
    else:
        messages.insert(0, {"role": "system", "content": text})
    return messages, None


def _message(m: ChatMessage, i: int, fmt: ToolCallFormat) -> list[dict[str, Any]]:
    out: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.role == "tool":
        if not m.tool_call_id:
            raise ValidationError(f"`messages[{i}].tool_call_id` is required for a `tool` message")
        out["tool_call_id"] = _template_id(m.tool_call_id, fmt)
    if not m.tool_calls:
        return [out]
    calls = [_past_call(c, i, j) for j, c in enumerate(m.tool_calls)]
    if fmt.describe_in_prompt:
        out["content"] = (out["content"] + calls_text([c for _, c in calls], fmt)).strip()
        return [out]
    out["tool_calls"] = [{"id": _template_id(cid, fmt), "type": "function",
                          "function": {"name": c.name, "arguments": json.loads(c.arguments)}} for cid, c in calls]
    if fmt.name != "llama3" or len(calls) == 1:
        return [out]
    return [{**out, "content": out["content"] if j == 0 else "", "tool_calls": [call]}
            for j, call in enumerate(out["tool_calls"])]


def _past_call(item: dict[str, Any], i: int, j: int) -> tuple[str, ToolCall]:
    function = item.get("function") or {}
    name, arguments = function.get("name"), function.get("arguments", "{}")
    if not isinstance(name, str) or not name:
        raise ValidationError(f"`messages[{i}].tool_calls[{j}].function.name` is required")
    try:
        if not isinstance(json.loads(arguments), dict):
            raise ValueError
    except (TypeError, ValueError):
        raise ValidationError(f"`messages[{i}].tool_calls[{j}].function.arguments` must be a JSON object "
                              "text") from None
    return str(item.get("id") or ""), ToolCall(name, arguments)


_ALNUM = string.ascii_letters + string.digits


def new_call_id(fmt: ToolCallFormat | None = None) -> str:
    """OpenAI's `call_...`; Mistral's templates refuse any id but 9 letters or digits."""
    if fmt is not None and fmt.name == "mistral":
        return "".join(secrets.choice(_ALNUM) for _ in range(9))
    return f"call_{uuid.uuid4().hex[:24]}"


def _template_id(call_id: str, fmt: ToolCallFormat) -> str:
    if fmt.name != "mistral" or (len(call_id) == 9 and call_id.isascii() and call_id.isalnum()):
        return call_id
    digest = hashlib.sha256(call_id.encode()).digest()
    return "".join(_ALNUM[b % len(_ALNUM)] for b in digest[:9])
