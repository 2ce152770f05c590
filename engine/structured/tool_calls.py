"""Tool calls: how a model's chat template marks one, the grammar that forces (`required`, named) or allows
(`auto`) one, and reading it back from the generated text.

A call is always generated as one JSON object with a fixed header, `{"name": "<tool>", "<args key>": <arguments>}`,
wrapped in the template's markers:

| template mentions | format | text the model writes |
|---|---|---|
| `<tool_call>` (Hermes, Qwen2.5, Qwen3) | hermes | `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` |
| `[TOOL_CALLS]` (Mistral) | mistral | `[TOOL_CALLS][{"name": ..., "arguments": {...}}]` |
| `<|python_tag|>` (Llama 3.1/3.2) | llama3 | `{"name": ..., "parameters": {...}}` |
| none of these (SmolLM2, any template without tools) | json | `{"name": ..., "arguments": {...}}`; the tools are described in a system message |

A marker that is one special token of the vocabulary is forced as that token (`<[id]>` in the grammar), as the
model was trained to write it. `auto` is `start: TEXT | call`, where TEXT cannot begin with `{`, whitespace or
the marker: the model chooses with its first token, and once it has chosen a call, the tool's name and its
arguments' schema are enforced like `required`'s.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from engine.structured.spec import GrammarSpec, lark_spec

_HEADER = re.compile(r'\s*\{"name": "([^"]+)", "(?:arguments|parameters)": ')
_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(slots=True, frozen=True)
class ToolCallFormat:
    name: str
    prefix: str = ""            # text before the call object (a special token's text where it is one)
    suffix: str = ""
    args_key: str = "arguments"
    describe_in_prompt: bool = False     # the template ignores `tools`: we add them as a system message


FORMATS = {
    "hermes": ToolCallFormat("hermes", "<tool_call>\n", "\n</tool_call>"),
    "mistral": ToolCallFormat("mistral", "[TOOL_CALLS][", "]"),
    "llama3": ToolCallFormat("llama3", args_key="parameters"),
    "json": ToolCallFormat("json", describe_in_prompt=True),
}


@dataclass(slots=True, frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]


@dataclass(slots=True, frozen=True)
class ToolCall:
    name: str
    arguments: str          # JSON text, as OpenAI returns it


def detect_format(chat_template: str | None) -> ToolCallFormat:
    template = chat_template or ""
    if "tools" not in template:
        return FORMATS["json"]
    if "<tool_call>" in template:
        return FORMATS["hermes"]
    if "[TOOL_CALLS]" in template:
        return FORMATS["mistral"]
    if "<|python_tag|>" in template or '"parameters"' in template:
        return FORMATS["llama3"]
    return FORMATS["json"]


def header(fmt: ToolCallFormat, name: str) -> str:
    return f'{{"name": "{name}", "{fmt.args_key}": '


def tool_call_grammar(tools: list[Tool], fmt: ToolCallFormat, *, allow_text: bool, tokenizer: Any = None,
                      field: str = "tools") -> GrammarSpec:
    """One call to one of `tools` (or, with `allow_text`, free text instead)."""
    rules = [f"call: {_marker(fmt.prefix, tokenizer)} ({' | '.join(f'call_{i}' for i in range(len(tools)))}) "
             f"{_marker(fmt.suffix, tokenizer)}"]
    for i, tool in enumerate(tools):
        schema = {**closed(tool.parameters), "x-guidance": _LAYOUT}
        rules.append(f"call_{i}: {json.dumps(header(fmt, tool.name))} args_{i} \"}}\"")
        rules.append(f"args_{i}: %json {json.dumps(schema)}")
    if allow_text:
        first = "{" + (fmt.prefix[:1] if fmt.prefix else "")
        rules.insert(0, f"start: TEXT | call\nTEXT: /[^{re.escape(first)}\\s][\\s\\S]*/")
    else:
        rules.insert(0, "start: call")
    return lark_spec("\n".join(rules), field)


def closed(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` on every object that lists `properties` and says nothing about
    others. A tool cannot use arguments it does not declare, and a small model left free to invent them (SmolLM2
    under `required` wrote `"unitStyle"`, `"properties"`, `"apiKey"`...) can go on until `max_tokens`, which cuts
    the call off: no tool call at all."""
    if isinstance(schema, list):
        return [closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: closed(value) if key not in ("const", "enum", "default", "examples") else value
           for key, value in schema.items()}
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def _marker(text: str, tokenizer: Any) -> str:
    """A grammar element for `text`: its special token when it is one (plus what follows), else the literal."""
    if not text:
        return ""
    stripped = text.strip()
    token_id = _special_token_id(tokenizer, stripped) if tokenizer is not None else None
    if token_id is None:
        return json.dumps(text)
    before, after = text.split(stripped, 1)
    parts = [json.dumps(before)] if before else []
    parts.append(f"<[{token_id}]>")
    if after:
        parts.append(json.dumps(after))
    return " ".join(parts)


def _special_token_id(tokenizer: Any, text: str) -> int | None:
    for token, token_id in getattr(tokenizer, "added_tokens_encoder", {}).items():
        if token == text:
            return int(token_id)
    return None


def parse_tool_call(text: str, fmt: ToolCallFormat, tools: list[Tool]) -> ToolCall | None:
    """The call in `text` (markers as text, or already dropped as special tokens), or None for plain text."""
    body = text.strip()
    prefix, suffix = fmt.prefix.strip(), fmt.suffix.strip()
    if prefix and body.startswith(prefix):
        body = body[len(prefix):].strip()
    if suffix and body.endswith(suffix):
        body = body[:-len(suffix)].strip()
    if fmt.name == "mistral" and body.startswith("[") and body.endswith("]"):
        body = body[1:-1]   # its marker was a special token, dropped from the text; the list remains
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or set(obj) != {"name", fmt.args_key}:
        return None
    if obj["name"] not in {t.name for t in tools} or not isinstance(obj[fmt.args_key], dict):
        return None
    # the arguments as the model wrote them, so that streamed pieces and this agree to the byte
    match = _HEADER.match(body)
    raw = body[match.end():-1].strip() if match and body.endswith("}") else ""
    return ToolCall(obj["name"], raw if _is_object(raw) else json.dumps(obj[fmt.args_key]))


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def describe_tools(tools: list[Tool], fmt: ToolCallFormat, *, required: bool) -> str:
    """The system text that tells a model whose template ignores `tools` what it may call, and how."""
    listing = json.dumps([{"name": t.name, "description": t.description, "parameters": t.parameters}
                          for t in tools])
    how = (f'To call a function, answer with only a JSON object: {header(fmt, "<function name>")}'
           f'<arguments object>}}.')
    choose = "You must call one of them." if required else "If none of them is needed, answer normally."
    return f"You can call these functions:\n{listing}\n{how} {choose}"


def call_text(call: ToolCall, fmt: ToolCallFormat) -> str:
    """How the model would have written `call` (an earlier assistant turn sent back to a template without tools)."""
    return f"{fmt.prefix}{header(fmt, call.name)}{call.arguments}}}{fmt.suffix}"


class ToolCallStream:
    """Streamed text -> OpenAI deltas: ("content", text), or one call as ("name", name) then ("arguments", text)
    pieces. With `allow_text` the first visible character decides (a call starts with `{` or its marker); the
    call's closing `}` and marker are held back, so the argument pieces concatenate to exactly its arguments."""

    def __init__(self, fmt: ToolCallFormat, tools: list[Tool], allow_text: bool):
        self.fmt, self.tools = fmt, tools
        self.mode: str | None = None if allow_text else "call"
        self.buffer = ""
        self.name_sent = False
        self.args_sent = 0
        self._holdback = 1 + len(fmt.suffix)

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.buffer += text
        if self.mode is None:
            visible = self.buffer.lstrip()
            prefix = self.fmt.prefix.strip()
            if not visible or (prefix and prefix.startswith(visible) and visible != prefix):
                return []       # nothing decides yet
            self.mode = "call" if visible[0] == "{" or (prefix and visible.startswith(prefix)) \
                or visible != self.buffer else "content"
        if self.mode == "content":
            out, self.buffer = self.buffer, ""
            return [("content", out)] if out else []
        return self._call_pieces()

    def _call_pieces(self) -> list[tuple[str, str]]:
        body = self.buffer.split(self.fmt.prefix.strip(), 1)[-1] if self.fmt.prefix.strip() else self.buffer
        match = _HEADER.search(body)
        if match is None:
            return []
        out = []
        if not self.name_sent:
            self.name_sent = True
            out.append(("name", match.group(1)))
        ready = body[match.end():max(match.end(), len(body) - self._holdback)]
        if len(ready) > self.args_sent:
            out.append(("arguments", ready[self.args_sent:]))
            self.args_sent = len(ready)
        return out

    def finish(self, text: str) -> tuple[list[tuple[str, str]], ToolCall | None]:
        """The last pieces once the whole `text` is known, and the call it holds (None: plain text or cut off)."""
        if self.mode == "content" or (self.mode is None and self.buffer):
            out, self.buffer = self.buffer, ""
            return ([("content", out)] if out else []), None
        call = parse_tool_call(text, self.fmt, self.tools)
        if call is None:
            return [], None
        out = [] if self.name_sent else [("name", call.name)]
        if len(call.arguments) > self.args_sent:
            out.append(("arguments", call.arguments[self.args_sent:]))
        return out, call
