"""Tool calls: how each model family writes them, the grammar that forces (`required`, named) or allows (`auto`)
them, one or several per turn, and reading them back from the generated text, whole or streamed.

Every call is generated as one JSON object with a fixed header, `{"name": "<tool>", "<args key>": <arguments>}`,
or, for a family that writes the name outside the JSON (`name_sep`), as `NAME<name_sep><arguments>`; the family's
markers go around each call or around the list:

| parser | template mentions | text the model writes for two calls |
|---|---|---|
| hermes (Hermes, Qwen2.5, Qwen3) | `<tool_call>` | `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>\\n<tool_call>\\n...</tool_call>` |
| mistral | `[TOOL_CALLS]` | `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, {...}]` |
| llama3 (Llama 3.1/3.2 JSON) | `<|python_tag|>` or `"parameters"` | `{"name": ..., "parameters": {...}}; {...}` (`<|python_tag|>` first is read too) |
| deepseek_v3 (DeepSeek-V3.1) | `<｜tool▁call▁begin｜>` | `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`; tools described in a system message (its template does not render them) |
| deepseek_r1 (DeepSeek-R1, its distills, V3-0324) | `<｜tool▁call▁begin｜>` and `` ```json `` | `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>\\n<｜tool▁call▁begin｜>...<｜tool▁calls▁end｜>`; tools described in a system message |
| json (SmolLM2, any template without tools) | none of these | `{"name": ..., "arguments": {...}}\\n{...}`; tools described in a system message |
| harmony (gpt-oss) | `<|channel|>` | one message per call, `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`; read and forced by engine.server.harmony |

`--tool-call-parser` forces one; `auto` reads the chat template. A marker that is one special token of the
vocabulary is forced as that token (`<[id]>` in the grammar), as the model was trained to write it. `auto` is
`start: TEXT | calls`, where TEXT cannot begin with `{`, whitespace or the marker: the model chooses with its first
token, and once it has chosen a call, the tool's name and its arguments' schema are enforced like `required`'s.
With parallel calls the grammar allows up to MAX_CALLS of them. Reading back is strict: text that is not exactly
a sequence of well-formed calls to known tools (cut-off JSON, an unknown name, prose around the calls) is content.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from engine.structured.spec import GrammarSpec, lark_spec

_HEADER = re.compile(r'\{\s*"name"\s*:\s*"([^"\\]+)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)')
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_CALLS = 8           # calls per turn the grammar allows with parallel_tool_calls


@dataclass(slots=True, frozen=True)
class ToolCallFormat:
    name: str
    open: str = ""              # before the calls (a special token's text where it is one)
    close: str = ""             # after them
    call_open: str = ""         # around each call
    call_close: str = ""
    separator: str = ""         # between two calls
    args_key: str = "arguments"
    describe_in_prompt: bool = False     # the template ignores `tools`: we add them as a system message
    aliases: tuple[str, ...] = ()        # other openers the family writes (Llama's <|python_tag|>)
    name_sep: str = ""          # set: a call is name_prefix + NAME + name_sep + arguments + args_close (DeepSeek),
    name_prefix: str = ""       # not a JSON header
    args_close: str = ""
    parallel_by_default: bool = True     # without `parallel_tool_calls`, several calls per turn

    def markers(self) -> list[str]:
        """Marker texts the reader skips, longest first."""
        found = {m.strip() for m in (self.open, self.close, self.call_open, self.call_close, *self.aliases)}
        return sorted((m for m in found if m), key=len, reverse=True)


FORMATS = {
    "hermes": ToolCallFormat("hermes", call_open="<tool_call>\n", call_close="\n</tool_call>", separator="\n"),
    "mistral": ToolCallFormat("mistral", open="[TOOL_CALLS] [", close="]", separator=", ", aliases=("[TOOL_CALLS]",)),
    "llama3": ToolCallFormat("llama3", args_key="parameters", separator="; ", aliases=("<|python_tag|>",)),
    "deepseek_v3": ToolCallFormat("deepseek_v3", open="<｜tool▁calls▁begin｜>", close="<｜tool▁calls▁end｜>",
                                  call_open="<｜tool▁call▁begin｜>", call_close="<｜tool▁call▁end｜>",
                                  name_sep="<｜tool▁sep｜>", describe_in_prompt=True),
    "deepseek_r1": ToolCallFormat("deepseek_r1", open="<｜tool▁calls▁begin｜>", close="<｜tool▁calls▁end｜>",
                                  call_open="<｜tool▁call▁begin｜>", call_close="<｜tool▁call▁end｜>", separator="\n",
                                  name_prefix="function<｜tool▁sep｜>", name_sep="\n```json\n", args_close="\n```",
                                  describe_in_prompt=True),
    "json": ToolCallFormat("json", separator="\n", describe_in_prompt=True, parallel_by_default=False),
}
HARMONY = ToolCallFormat("harmony", parallel_by_default=False)  # messages, not JSON: engine.server.harmony's own
PARSERS = ("auto", *FORMATS, "harmony")


@dataclass(slots=True, frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]


@dataclass(slots=True, frozen=True)
class ToolCall:
    name: str
    arguments: str          # JSON text, as OpenAI returns it


def detect_format(chat_template: str | None, parser: str = "auto") -> ToolCallFormat:
    """The format `parser` names, or (auto) the one the chat template writes."""
    if parser != "auto":
        return HARMONY if parser == "harmony" else FORMATS[parser]
    template = chat_template or ""
    if "<|channel|>" in template:       # gpt-oss: calls are messages to functions.NAME
        return HARMONY
    if "<｜tool▁call▁begin｜>" in template:     # before the check for `tools`: these templates never render them
        return FORMATS["deepseek_r1" if "```json" in template else "deepseek_v3"]
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
    if fmt.name_sep:
        return f"{fmt.name_prefix}{name}{fmt.name_sep}"
    return f'{{"name": "{name}", "{fmt.args_key}": '


def trailer(fmt: ToolCallFormat) -> str:
    """What closes a call's JSON header after its arguments."""
    return fmt.args_close if fmt.name_sep else "}"


def header_pattern(fmt: ToolCallFormat) -> re.Pattern[str]:
    """A call's header in streamed text; group 1 is the tool's name, the arguments start at its end."""
    if fmt.name_sep:
        return re.compile(rf"{_loose(fmt.name_prefix)}([\w.\-]+){_spaced(fmt.name_sep)}\s*(?=\S)")
    return _HEADER


def _spaced(text: str) -> str:
    """A regex for `text` whose whitespace may vary."""
    return r"\s*" + r"\s*".join(re.escape(word) for word in text.split()) if text.strip() else r"\s*"


def _loose(text: str) -> str:
    """A regex for `text` as it may be decoded: whitespace varies, and its special tokens may be gone."""
    parts = [f"(?:{re.escape(p)})?" if p.startswith("<｜") else _spaced(p)
             for p in re.split(r"(<｜[^｜]+｜>)", text) if p]
    return "".join(parts) + r"\s*" if parts else ""


def tool_call_grammar(tools: list[Tool], fmt: ToolCallFormat, *, allow_text: bool, tokenizer: Any = None,
                      parallel: bool = True, field: str = "tools") -> GrammarSpec:
    """Calls to `tools`: one, or with `parallel` up to MAX_CALLS (or, with `allow_text`, free text instead)."""
    more = f" ({grammar_marker(fmt.separator, tokenizer)} call){{0,{MAX_CALLS - 1}}}" \
        if parallel and (fmt.separator or fmt.call_open) else ""
    rules = [f"calls: {grammar_marker(fmt.open, tokenizer)} call{more} {grammar_marker(fmt.close, tokenizer)}",
             f"call: {grammar_marker(fmt.call_open, tokenizer)} ({' | '.join(f'call_{i}' for i in range(len(tools)))}) "
             f"{grammar_marker(fmt.call_close, tokenizer)}"]
    for i, tool in enumerate(tools):
        schema = {**closed(tool.parameters), "x-guidance": JSON_LAYOUT}
        if fmt.name_sep:
            rules.append(f"call_{i}: {grammar_marker(fmt.name_prefix, tokenizer)} {json.dumps(tool.name)} "
                         f"{grammar_marker(fmt.name_sep, tokenizer)} args_{i} {grammar_marker(fmt.args_close, tokenizer)}")
        else:
            rules.append(f"call_{i}: {json.dumps(header(fmt, tool.name))} args_{i} \"}}\"")
        rules.append(f"args_{i}: %json {json.dumps(schema)}")
    if allow_text:
        opener = (fmt.open or fmt.call_open).strip()
        first = "{" + opener[:1]
        rules.insert(0, f"start: TEXT | calls\nTEXT: /[^{re.escape(first)}\\s][\\s\\S]*/")
    else:
        rules.insert(0, "start: calls")
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


def grammar_marker(text: str, tokenizer: Any) -> str:
    """A grammar element for `text`: each added token of the vocabulary in it forced as that token (`<[id]>`), the
    rest as literals."""
    if not text:
        return ""
    added = getattr(tokenizer, "added_tokens_encoder", {}) if tokenizer is not None else {}
    specials = {token: int(i) for token, i in added.items() if len(token.strip()) > 1 and token in text}
    if not specials:
        return json.dumps(text)
    pattern = re.compile("|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True)))
    parts, at = [], 0
    for match in pattern.finditer(text):
        if match.start() > at:
            parts.append(json.dumps(text[at:match.start()]))
        parts.append(f"<[{specials[match.group()]}]>")
        at = match.end()
    if at < len(text):
        parts.append(json.dumps(text[at:]))
    return " ".join(parts)


# --- reading calls back --------------------------------------------------------------------------

def parse_tool_calls(text: str, fmt: ToolCallFormat, tools: list[Tool], cut_off: bool = False) -> list[ToolCall] | None:
    """The calls in `text` (markers as text, or already dropped as special tokens), or None: plain text. With
    `cut_off` (the answer hit its token limit) the complete calls before a cut-off one are the answer's calls."""
    known = {t.name for t in tools}
    markers = fmt.markers()
    if fmt.name_sep:
        return _parse_named(text, fmt, known, markers, cut_off)
    calls: list[ToolCall] = []
    decoder = json.JSONDecoder()
    at, n = 0, len(text)
    while at < n:
        if text[at].isspace() or text[at] in ";,":
            at += 1
            continue
        marker = next((m for m in markers if text.startswith(m, at)), None)
        if marker is not None:
            at += len(marker)
            continue
        if fmt.name == "mistral" and text[at] in "[]":    # its list, once [TOOL_CALLS] is dropped as special
            at += 1
            continue
        if cut_off and calls and _cut_off_call(text[at:], markers):
            return calls
        if text[at] != "{":
            return None
        try:
            obj, end = decoder.raw_decode(text, at)
        except ValueError:
            return None
        call = _call(obj, text[at:end], fmt, known)
        if call is None:
            return None
        calls.append(call)
        at = end
    return calls or None


def _parse_named(text: str, fmt: ToolCallFormat, known: set[str], markers: list[str],
                 cut_off: bool) -> list[ToolCall] | None:
    """parse_tool_calls for NAME<name_sep>{...} calls (the separator may be gone, dropped as a special token)."""
    name_at = re.compile(rf"{_loose(fmt.name_prefix)}([\w.\-]+)(?:{_spaced(fmt.name_sep)})?\s*(?=\{{)")
    args_close = re.compile(rf"(?:{_spaced(fmt.args_close)})?") if fmt.args_close else None
    calls: list[ToolCall] = []
    at, n = 0, len(text)
    while at < n:
        if text[at].isspace():
            at += 1
            continue
        marker = next((m for m in markers if text.startswith(m, at)), None)
        if marker is not None:
            at += len(marker)
            continue
        match = name_at.match(text, at)
        end = _json_end(text, match.end()) if match else None
        if match is None or end is None:
            return calls if cut_off and calls else None
        name, args = match.group(1), text[match.end():end]
        if name not in known or not is_json_object(args):
            return None
        calls.append(ToolCall(name, args))
        at = args_close.match(text, end).end() if args_close else end
    return calls or None


def _cut_off_call(rest: str, markers: list[str]) -> bool:
    """Whether `rest` is the beginning of one more call that the token limit cut off."""
    if rest.startswith("{"):
        return _json_end(rest, 0) is None
    return any(m.startswith(rest) for m in markers)


def parse_tool_call(text: str, fmt: ToolCallFormat, tools: list[Tool]) -> ToolCall | None:
    """The one call in `text`, or None (plain text, or several calls)."""
    calls = parse_tool_calls(text, fmt, tools)
    return calls[0] if calls and len(calls) == 1 else None


def _call(obj: Any, raw: str, fmt: ToolCallFormat, known: set[str]) -> ToolCall | None:
    if not isinstance(obj, dict) or set(obj) != {"name", fmt.args_key}:
        return None
    if obj["name"] not in known or not isinstance(obj[fmt.args_key], dict):
        return None
    # the arguments as the model wrote them, so that streamed pieces and this agree to the byte
    match = _HEADER.match(raw)
    args = raw[match.end():-1].rstrip() if match else ""
    return ToolCall(obj["name"], args if is_json_object(args) else json.dumps(obj[fmt.args_key]))


def is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def _json_end(text: str, start: int) -> int | None:
    """Index just past the JSON object that starts at `text[start]` (`{`), or None while it is incomplete."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def describe_tools(tools: list[Tool], fmt: ToolCallFormat, *, required: bool) -> str:
    """The system text that tells a model whose template ignores `tools` what it may call, and how."""
    listing = json.dumps([{"name": t.name, "description": t.description, "parameters": t.parameters}
                          for t in tools])
    how = (f'To call a function, answer with only a JSON object: {header(fmt, "<function name>")}'
           f'<arguments object>}}.')
    if fmt.name_sep:
        how = f"To call a function, answer with only {calls_text([ToolCall('<name>', '<arguments object>')], fmt)}."

    choose = "You must call one of them." if required else "If none of them is needed, answer normally."
    return f"You can call these functions:\n{listing}\n{how} {choose}"


def call_text(call: ToolCall, fmt: ToolCallFormat) -> str:
    """How the model would have written `call` alone (an earlier turn sent back to a template without tools)."""
    return calls_text([call], fmt)


def calls_text(calls: list[ToolCall], fmt: ToolCallFormat) -> str:
    body = fmt.separator.join(f"{fmt.call_open}{header(fmt, c.name)}{c.arguments}{trailer(fmt)}{fmt.call_close}"
                              for c in calls)
    return f"{fmt.open}{body}{fmt.close}"


# --- streaming -----------------------------------------------------------------------------------

@dataclass(slots=True)
class _Streamed:
    name: str
    args_at: int            # where its arguments start in the buffer
    sent: int = 0           # argument characters sent


@dataclass(slots=True)
class ToolCallStream:
    """Streamed text -> (kind, text, index) pieces: ("content", text, 0), or for call i ("name", name, i) then
    ("arguments", text, i) pieces. With `allow_text` the first visible character decides (a call starts with `{`
    or a marker). A call's name goes out once its header is complete and names a known tool, its arguments as
    they come, up to the end of their object: the pieces of call i concatenate to exactly its arguments."""

    fmt: ToolCallFormat
    tools: list[Tool]
    allow_text: bool
    mode: str | None = None
    buffer: str = ""
    calls: list[_Streamed] = field(default_factory=list)
    _scan: int = 0          # where to look for the next call's header

    def __post_init__(self) -> None:
        self.mode = None if self.allow_text else "call"

    def feed(self, text: str) -> list[tuple[str, str, int]]:
        self.buffer += text
        if self.mode is None:
            visible = self.buffer.lstrip()
            openers = [m for m in self.fmt.markers() if m not in (self.fmt.close.strip(), self.fmt.call_close.strip())]
            if not visible or any(m.startswith(visible) and m != visible for m in openers):
                return []       # nothing decides yet
            called = visible[0] in "{[" and (visible[0] == "{" or self.fmt.name == "mistral")
            self.mode = "call" if called or any(visible.startswith(m) for m in openers) else "content"
        if self.mode == "content":
            out, self.buffer = self.buffer, ""
            return [("content", out, 0)] if out else []
        return self._call_pieces()

    def _call_pieces(self) -> list[tuple[str, str, int]]:
        out: list[tuple[str, str, int]] = []
        known = {t.name for t in self.tools}
        while True:
            if self.calls:
                out += self._arguments(len(self.calls) - 1)
                end = _json_end(self.buffer, self.calls[-1].args_at)
                if end is None:
                    return out
                self._scan = end
            match = header_pattern(self.fmt).search(self.buffer, self._scan)
            if match is None or match.group(1) not in known:
                return out
            self.calls.append(_Streamed(match.group(1), match.end()))
            out.append(("name", match.group(1), len(self.calls) - 1))

    def _arguments(self, i: int) -> list[tuple[str, str, int]]:
        call = self.calls[i]
        end = _json_end(self.buffer, call.args_at)
        ready = self.buffer[call.args_at:end if end is not None else len(self.buffer)]
        if len(ready) <= call.sent:
            return []
        piece, call.sent = ready[call.sent:], len(ready)
        return [("arguments", piece, i)]

    def finish(self, text: str, cut_off: bool = False) -> tuple[list[tuple[str, str, int]], list[ToolCall] | None]:
        """The last pieces once the whole `text` is known, and its calls (None: plain text, or cut off after a call
        began to stream). A call cut off by the token limit after complete ones may have streamed its name and
        part of its arguments; it is not among the calls."""
        if self.mode == "content" or (self.mode is None and self.buffer):
            out, self.buffer = self.buffer, ""
            return ([("content", out, 0)] if out else []), None
        calls = parse_tool_calls(text, self.fmt, self.tools, cut_off)
        if calls is None:   # plain text after all: as content, unless part of a call went out already
            return ([] if self.calls or not self.buffer else [("content", self.buffer, 0)]), None
        out: list[tuple[str, str, int]] = []
        for i, call in enumerate(calls):
            if i >= len(self.calls):
                self.calls.append(_Streamed(call.name, 0))
                out.append(("name", call.name, i))
            sent = self.calls[i].sent
            if len(call.arguments) > sent:
                out.append(("arguments", call.arguments[sent:], i))
        return out, calls
