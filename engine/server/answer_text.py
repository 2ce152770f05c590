"""One answer's generated text read as the APIs return it: tool calls when the turn may call tools
(engine.structured.tool_calls), else a reasoning span and the answer (engine.server.reasoning), else plain content;
whole (`read_answer`) or streamed (`AnswerStream`). Chat completions, Anthropic Messages and Responses all read
their answers here."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.server.harmony import HarmonyStream, read_harmony
from engine.server.infer import Generation
from engine.server.reasoning import ReasoningFormat, reasoning_stream, split_reasoning
from engine.server.tools import ToolUse
from engine.structured.tool_calls import ToolCall, ToolCallStream, parse_tool_calls

Piece = tuple[str, str, int]    # (content | reasoning | name | arguments, text, tool call index)


@dataclass(slots=True)
class Answer:
    reasoning: str | None
    content: str
    calls: list[ToolCall] = field(default_factory=list)


def read_answer(text: str, use: ToolUse | None, thinks: ReasoningFormat | None, cut_off: bool = False) -> Answer:
    """`cut_off`: the answer hit its token limit (complete calls before a cut-off one are kept). Tool calls are read
    from what follows the reasoning span; harmony's (gpt-oss) from its messages, by engine.server.harmony."""
    if use is not None and use.fmt.name == "harmony":
        reasoning, content, calls = read_harmony(text, {t.name for t in use.tools})
        return Answer(reasoning, "", calls) if calls else Answer(reasoning, content)
    reasoning, content = split_reasoning(text, thinks) if thinks is not None else (None, text)
    calls = parse_tool_calls(content, use.fmt, use.tools, cut_off) if use is not None else None
    return Answer(reasoning, "", calls) if calls else Answer(reasoning, content)


class AnswerStream:
    """Each event's text -> pieces (the reasoning span first, then tool calls or content); once the last event is
    in, `calls` holds the answer's tool calls (empty when it answered in text, or its only call was cut off)."""

    def __init__(self, use: ToolUse | None, thinks: ReasoningFormat | None):
        self.harmony = HarmonyStream({t.name for t in use.tools}) \
            if use is not None and use.fmt.name == "harmony" else None
        self.tools = ToolCallStream(use.fmt, use.tools, use.allow_text) \
            if use is not None and self.harmony is None else None
        self.reasoning = reasoning_stream(thinks) if thinks is not None and self.harmony is None else None
        self.content = ""           # the text after the reasoning span, which the tool calls are read from
        self.calls: list[ToolCall] = []

    def feed(self, text: str, end: Generation | None) -> list[Piece]:
        if self.harmony is not None:
            return self._harmony(text, end)
        if self.reasoning is not None:
            parts = self.reasoning.feed(text) + (self.reasoning.finish() if end is not None else [])
        else:
            parts = [("content", text)]
        pieces: list[Piece] = []
        for kind, part in parts:
            if kind == "reasoning":
                pieces.append(("reasoning", part, 0))
            elif self.tools is not None:
                self.content += part
                pieces += self.tools.feed(part)
            elif part:
                pieces.append(("content", part, 0))
        if end is not None and self.tools is not None:
            last, calls = self.tools.finish(self.content, end.finish_reason == "length")
            pieces += last
            self.calls = calls or []
        return pieces

    def _harmony(self, text: str, end: Generation | None) -> list[Piece]:
        """gpt-oss: reasoning, content and calls all come from harmony's messages (each call's index is its
        place among the messages to functions)."""
        stream = self.harmony
        parts = stream.feed(text) + (stream.finish() if end is not None else [])
        pieces: list[Piece] = []
        calls = 0 if not stream.calls else len(stream.calls) - sum(1 for kind, _ in parts if kind == "name")
        for kind, part in parts:
            if kind == "name":
                calls += 1
            if part or kind == "name":
                pieces.append((kind, part, max(calls - 1, 0)))
        if end is not None:
            self.calls = stream.tool_calls()
        return pieces
