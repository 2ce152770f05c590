"""gpt-oss's harmony format read as reasoning and answer (`--reasoning-parser gpt_oss`, or `auto` on a template
that writes `<|channel|>`).

After the generation prompt `<|start|>assistant` the model writes messages, each a header, `<|message|>`, a body
and an end (`<|end|>`, or `<|return|>` / `<|call|>` for its last):

    <|channel|>analysis<|message|>thinking…<|end|><|start|>assistant<|channel|>final<|message|>answer<|return|>

The `analysis` channel is the reasoning; `final` (and `commentary`: preambles, calls' arguments) is the answer.
Text that does not open with a header (an answer under a grammar) is all answer. The markers are special tokens,
so a server with this parser keeps special tokens in the decoded text (engine.server.app).
"""
from __future__ import annotations

from engine.server.reasoning import _partial_suffix

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")


class HarmonyStream:
    """Streamed text -> ("reasoning", text) and ("content", text) pieces, like engine.server.reasoning's
    ReasoningStream: a marker split across tokens is held back until it is known."""

    def __init__(self) -> None:
        self.mode = "start"         # start | header | body | plain
        self.kind = "content"       # the open message's kind
        self.buffer = ""
        self.saw_reasoning = False

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
                channel = self.buffer[:at].partition(CHANNEL)[2].split(" ", 1)[0].strip()
                self.kind = "reasoning" if channel == "analysis" else "content"
                self.saw_reasoning |= self.kind == "reasoning"
                self.mode, self.buffer = "body", self.buffer[at + len(MESSAGE):]
            if self.mode == "body":
                ends = [(i, tag) for tag in ENDS if (i := self.buffer.find(tag)) >= 0]
                if not ends:
                    ready = len(self.buffer) - max(_partial_suffix(self.buffer, tag) for tag in ENDS)
                    if ready:
                        out.append((self.kind, self.buffer[:ready]))
                        self.buffer = self.buffer[ready:]
                    return out
                at, tag = min(ends)
                if at:
                    out.append((self.kind, self.buffer[:at]))
                self.mode, self.buffer = "header", self.buffer[at + len(tag):]

    def finish(self) -> list[tuple[str, str]]:
        """What is held back once the text has ended: a body cut off keeps its kind, a header cut off is dropped."""
        rest, self.buffer = self.buffer, ""
        if not rest or self.mode == "header":
            return []
        if self.mode == "start":
            return [("content", rest)] if rest.strip() else []
        return [("content" if self.mode == "plain" else self.kind, rest)]

