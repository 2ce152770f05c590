"""gpt-oss's harmony format read as reasoning and answer (`--reasoning-parser gpt_oss`, or `auto` on a template
that writes `<|channel|>`).

After the generation prompt `<|start|>assistant` the model writes messages, each a header, `<|message|>`, a body
and an end (`<|end|>`, or `<|return|>` / `<|call|>` for its last):

    <|channel|>analysis<|message|>thinking…<|end|><|start|>assistant<|channel|>final<|message|>answer<|return|>

The `analysis` channel is the reasoning; `final` (and `commentary`: preambles) is the answer.
Text that does not open with a header (an answer under a grammar) is all answer. The markers are special tokens,
so a server with this parser keeps special tokens in the decoded text (engine.server.app).

Tool calls (`--tool-call-parser harmony`, or `auto` on such a template) are messages to a function, the
recipient in the header, before or after the channel, the arguments as the body:

    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

With the request's tools known, such a message streams as ("name", NAME) then ("arguments", text) pieces; a
message to any other recipient (an unknown function, a built-in tool) is content. A call is one whose arguments
are a JSON object once the text has ended (`<|call|>` is an end token, so it is often not in the text at all).
`call_grammar` forces a call (`required`, named): an analysis message may come first, then one call.
`final_grammar` puts a request's answer grammar (response_format) in the final message. A reasoning budget bounds
the analysis message in both, which it then makes required: past the budget only `<|end|>` may follow, and the
final message's header (or a call's) is forced, as `</think>` is for `<think>`-style models.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection
from typing import Any

from engine.server.reasoning import _partial_suffix
from engine.structured.spec import GrammarSpec, lark_spec
from engine.structured.tool_calls import JSON_LAYOUT, Tool, ToolCall, closed, grammar_marker, is_json_object

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")
FUNCTIONS = "functions."
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


class HarmonyStream:
    """Streamed text -> ("reasoning", text) and ("content", text) pieces, like engine.server.reasoning's
    ReasoningStream: a marker split across tokens is held back until it is known."""

    def __init__(self, tools: Collection[str] | None = None) -> None:
        self.mode = "start"         # start | header | body | plain
        self.kind = "content"       # the open message's kind: reasoning | content | arguments (a call)
        self.buffer = ""
        self.saw_reasoning = False
        self.tools = tools          # the functions that may be called; None: no tool calls are read
        self.calls: list[list[str]] = []    # [name, arguments so far] of each call message, in order

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.buffer += text
        out: list[tuple[str, str]] = []
        while True:
            if self.mode == "start":
                visible = self.buffer.lstrip()
                if visible.startswith((CHANNEL, START)):
                    self.mode, self.buffer = "header", visible
                elif visible and not (CHANNEL.startswith(visible) or START.startswith(visible)):
                    self.mode = "plain"
                else:
                    return out
            if self.mode == "plain":
                if self.buffer:
                    out.append(("content", self.buffer))
                self.buffer = ""
                return out
            if self.mode == "header":
                at = self.buffer.find(MESSAGE)
                if at < 0:
                    return out
                header = self.buffer[:at]
                channel = header.partition(CHANNEL)[2].split(" ", 1)[0].strip()
                self.kind = "reasoning" if channel == "analysis" else "content"
                self.saw_reasoning |= self.kind == "reasoning"
                name = self._called(header)
                if name is not None:
                    self.kind = "arguments"
                    self.calls.append([name, ""])
                    out.append(("name", name))
                self.mode, self.buffer = "body", self.buffer[at + len(MESSAGE):]
            if self.mode == "body":
                ends = [(i, tag) for tag in ENDS if (i := self.buffer.find(tag)) >= 0]
                if not ends:
                    ready = len(self.buffer) - max(_partial_suffix(self.buffer, tag) for tag in ENDS)
                    if ready:
                        out.append(self._piece(self.buffer[:ready]))
                        self.buffer = self.buffer[ready:]
                    return out
                at, tag = min(ends)
                if at:
                    out.append(self._piece(self.buffer[:at]))
                self.mode, self.buffer = "header", self.buffer[at + len(tag):]

    def _called(self, header: str) -> str | None:
        """The known function a message's header sends it to, if any."""
        if self.tools is None:
            return None
        found = _RECIPIENT.search(header)
        recipient = found.group(1) if found else ""
        name = recipient[len(FUNCTIONS):] if recipient.startswith(FUNCTIONS) else None
        return name if name in self.tools else None

    def _piece(self, text: str) -> tuple[str, str]:
        if self.kind == "arguments":
            self.calls[-1][1] += text
        return self.kind, text

    def finish(self) -> list[tuple[str, str]]:
        """What is held back once the text has ended: a body cut off keeps its kind, a header cut off is dropped."""
        rest, self.buffer = self.buffer, ""
        if not rest or self.mode == "header":
            return []
        if self.mode == "start":
            return [("content", rest)] if rest.strip() else []
        if self.mode == "plain":
            return [("content", rest)]
        return [self._piece(rest)]

    def tool_calls(self) -> list[ToolCall]:
        """The calls once the text has ended: those whose arguments are a JSON object (one cut off, or with
        other text for arguments, is not a call)."""
        return [ToolCall(name, args) for name, args in self.calls if is_json_object(args)]


def read_harmony(text: str, tools: Collection[str]) -> tuple[str | None, str, list[ToolCall]]:
    """(reasoning or None, content, calls) of a whole answer; a call message whose arguments are not a JSON object
    is content, so nothing the model wrote is lost."""
    stream = HarmonyStream(tools)
    pieces = stream.feed(text) + stream.finish()
    reasoning = "".join(t for kind, t in pieces if kind == "reasoning")
    content = "".join(t for kind, t in pieces if kind == "content")
    content += "".join(args for _, args in stream.calls if not is_json_object(args))
    return (reasoning if stream.saw_reasoning else None), content, stream.tool_calls()


def analysis_spans(text: str) -> list[tuple[int, int]]:
    """[start, end) of each analysis message in `text`, from its header (its `<|start|>`, when there is one) to
    past its end marker, or to the end of a text cut off inside it."""
    spans = []
    for found in re.finditer(re.escape(CHANNEL) + r"analysis\b", text):
        start = found.start()
        if text.endswith(START + "assistant", 0, start):
            start -= len(START + "assistant")
        ends = [(i, tag) for tag in ENDS if (i := text.find(tag, found.end())) >= 0]
        at, tag = min(ends) if ends else (len(text), "")
        spans.append((start, at + len(tag)))
    return spans


def call_grammar(tools: list[Tool], tokenizer: Any, field: str = "tools", budget: int | None = None,
                 allow_text: bool = False) -> GrammarSpec:
    """A turn that calls one of `tools` in harmony: an analysis message (optional without a `budget`, else of at
    most `budget` tokens), then one call message, or with `allow_text` (`auto` under a budget) a call or a final
    message (the markers forced as the special tokens they are)."""
    mark = _marks(tokenizer)
    calls = " | ".join(f"call_{i}" for i in range(len(tools)))
    rules = [f"start: {_first(budget)} {'(call | final)' if allow_text else 'call'}", *_analysis(mark, budget),
             f"call: {mark(CHANNEL)} \"commentary to=functions.\" ({calls})"]
    if allow_text:
        rules += [f"final: {mark(CHANNEL)} \"final\" {mark(MESSAGE)} /(.|\\n)*/"]
    for i, tool in enumerate(tools):
        schema = {**closed(tool.parameters), "x-guidance": JSON_LAYOUT}
        rules.append(f"call_{i}: {json.dumps(tool.name + ' ')} {mark(CONSTRAIN)} \"json\" {mark(MESSAGE)} args_{i} "
                     f"{mark('<|call|>')}")
        rules.append(f"args_{i}: %json {json.dumps(schema)}")
    return lark_spec("\n".join(rules), field)


def final_grammar(answer: str | None, budget: int | None, tokenizer: Any, field: str) -> GrammarSpec:
    """An analysis message (optional without a `budget`, else of at most `budget` tokens), then the final message,
    whose body is `answer` (a Lark rule named `answer`, e.g. a JSON schema's; None: free text). Past the budget only
    `<|end|>` may follow, and the grammar then forces `<|start|>assistant<|channel|>final<|message|>`, as `</think>`
    for the others."""
    mark = _marks(tokenizer)
    rules = [f"start: {_first(budget)} {mark(CHANNEL)} \"final\" {mark(MESSAGE)} answer", *_analysis(mark, budget),
             answer or "answer: /(.|\\n)*/"]
    return lark_spec("\n".join(rules), field)


def _analysis(mark: Callable[[str], str], budget: int | None) -> list[str]:
    """The rules of one analysis message and the header that follows it. A body cannot hold a special token, so
    the message ends only with `<|end|>` (a `stop` where the markers are text), and no second analysis message
    can open to step around the budget."""
    end = mark("<|end|>")
    limits = ([] if end.startswith("<[") else [f"stop={end}"]) + ([] if budget is None else [f"max_tokens={budget}"])
    return [f"analysis: {mark(CHANNEL)} \"analysis\" {mark(MESSAGE)} thought {end} {mark(START)} \"assistant\"",
            f"thought{'[' + ', '.join(limits) + ']' if limits else ''}: /(.|\\n)*/"]


def _first(budget: int | None) -> str:
    """A budget asks for reasoning, and gpt-oss always opens with an analysis message (it may be empty): under one
    the message is required, so that a turn cannot skip to its answer and report no reasoning at all."""
    return "analysis?" if budget is None else "analysis"


def _marks(tokenizer: Any) -> Callable[[str], str]:
    return lambda text: grammar_marker(text, tokenizer)
