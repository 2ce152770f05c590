"""Reasoning output: a reasoning model's `<think>…</think>` span split from its answer, as `reasoning_content` on
chat completions, Messages and Responses (streamed and not), chosen by
`--reasoning-parser auto|qwen3|deepseek_r1|gpt_oss|none` (gpt_oss: harmony channels, engine.server.harmony).

| parser | the model writes | reasoning is |
|---|---|---|
| qwen3 | `<think>…</think>answer` (or no span at all: thinking off) | the span, when the text opens with `<think>` |
| deepseek_r1 | `…</think>answer`: the R1 distills' template opens `<think>` in the prompt | all before `</think>` (all of a text cut off before it) |

`auto` reads the chat template: one that writes `<think>` into the generation prompt is deepseek_r1, one that
otherwise mentions `<think>` is qwen3, any other has no reasoning parser. Each answer then follows its prompt
(`for_prompt`): a prompt ending in `</think>` (thinking off) has no span to read, one ending in `<think>` is inside it.

`after_reasoning` wraps a request's grammar (tool calls, response_format) so that it applies only after the span
ends, and a reasoning budget (`max_reasoning_tokens`) ends the span: past that many tokens the grammar allows
only `</think>`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engine.structured.spec import GrammarSpec, lark_spec

PARSERS = ("auto", "qwen3", "deepseek_r1", "gpt_oss", "none")
START, END = "<think>", "</think>"


@dataclass(slots=True, frozen=True)
class ReasoningFormat:
    name: str
    opened_in_prompt: bool      # the output starts inside the span (deepseek_r1)


def reasoning_format(parser: str, chat_template: str | None) -> ReasoningFormat | None:
    if parser == "qwen3":
        return ReasoningFormat("qwen3", False)
    if parser == "deepseek_r1":
        return ReasoningFormat("deepseek_r1", True)
    if parser == "gpt_oss" or (parser == "auto" and chat_template and "<|channel|>" in chat_template):
        return ReasoningFormat("gpt_oss", False)
    if parser != "auto" or not chat_template or START not in chat_template:
        return None
    # R1 distills: {% if add_generation_prompt %}{{'<｜Assistant｜><think>\n'}}{% endif %}
    opened = any(f"{START}\\n'" in part or f"{START}\n'" in part
                 for part in chat_template.split("add_generation_prompt")[1:])
    return ReasoningFormat("deepseek_r1" if opened else "qwen3", opened)


def for_prompt(fmt: ReasoningFormat | None, prompt: str) -> ReasoningFormat | None:
    """The format of one answer, from where its rendered prompt ends: a prompt that closed the span (Qwen3's and
    DeepSeek-V3.1's thinking off: `…</think>`) gets no reasoning, one that opened it (`…<think>`) starts inside it."""
    if fmt is None:
        return None
    tail = prompt.rstrip()
    if tail.endswith(END):
        return None
    if tail.endswith(START) and not fmt.opened_in_prompt:
        return ReasoningFormat(fmt.name, True)
    return fmt


def split_reasoning(text: str, fmt: ReasoningFormat) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole answer."""
    stream = reasoning_stream(fmt)
    pieces = stream.feed(text) + stream.finish()
    reasoning = "".join(t for kind, t in pieces if kind == "reasoning")
    content = "".join(t for kind, t in pieces if kind == "content")
    return (reasoning if stream.saw_reasoning else None), content


def reasoning_stream(fmt: ReasoningFormat) -> Any:
    """A ReasoningStream, or for gpt_oss a HarmonyStream (the same feed/finish)."""
    if fmt.name == "gpt_oss":
        from engine.server.harmony import HarmonyStream     # (it imports this module)
        return HarmonyStream()
    return ReasoningStream(fmt)


class ReasoningStream:
    """Streamed text -> ("reasoning", text) and ("content", text) pieces. A tag split across tokens is held back
    until it is known; the answer's leading whitespace after `</think>` is dropped."""

    def __init__(self, fmt: ReasoningFormat):
        self.mode = "reasoning" if fmt.opened_in_prompt else "start"
        self.saw_reasoning = fmt.opened_in_prompt
        self.buffer = ""
        self.after_end = False
        self.may_reopen = fmt.opened_in_prompt      # deepseek_r1 may still write the opening tag itself

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.buffer += text
        out: list[tuple[str, str]] = []
        while True:
            if self.mode == "start":
                visible = self.buffer.lstrip()
                if visible.startswith(START):
                    self.mode, self.saw_reasoning, self.buffer = "reasoning", True, visible[len(START):]
                elif visible and not START.startswith(visible):
                    self.mode = "content"
                else:
                    return out      # not decided yet
            if self.mode == "reasoning" and self.may_reopen:
                visible = self.buffer.lstrip()
                if visible.startswith(START):
                    self.buffer, self.may_reopen = visible[len(START):], False
                elif visible and not START.startswith(visible):
                    self.may_reopen = False
                else:
                    return out      # not decided yet
            if self.mode == "reasoning":
                at = self.buffer.find(END)
                if at < 0:
                    ready = len(self.buffer) - _partial_suffix(self.buffer, END)
                    if ready:
                        out.append(("reasoning", self.buffer[:ready]))
                        self.buffer = self.buffer[ready:]
                    return out
                if at:
                    out.append(("reasoning", self.buffer[:at]))
                self.buffer, self.mode, self.after_end = self.buffer[at + len(END):], "content", True
            if self.mode == "content":
                if self.after_end:
                    self.buffer = self.buffer.lstrip()
                    if not self.buffer:
                        return out
                    self.after_end = False
                if self.buffer:
                    out.append(("content", self.buffer))
                self.buffer = ""
                return out

    def finish(self) -> list[tuple[str, str]]:
        """What is held back once the text has ended (a span cut off before `</think>` stays reasoning)."""
        rest, self.buffer = self.buffer, ""
        if not rest or (self.mode == "content" and self.after_end and not rest.strip()):
            return []
        return [("reasoning" if self.mode == "reasoning" else "content", rest)]


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def after_reasoning(fmt: ReasoningFormat, answer: str | None, budget: int | None, field: str) -> GrammarSpec:
    """A grammar for the reasoning span (at most `budget` tokens) then `answer`: Lark rules whose entry is
    `answer` (None: free text). qwen3 may skip the span (thinking off); deepseek_r1's output starts inside it."""
    limit = f", max_tokens={budget}" if budget is not None else ""
    # free text after a qwen3 span cannot open one itself, or the budget could be stepped around
    free = "answer: /(.|\\n)*/" if fmt.opened_in_prompt else "answer: /([^<](.|\\n)*)?/"
    rules = [f"think[stop={json.dumps(END)}{limit}]: /(.|\\n)*/", "WS: /[ \\t\\r\\n]*/", answer or free]
    if fmt.opened_in_prompt:
        rules.insert(0, f"start: think {json.dumps(END)} WS answer")
    else:
        rules.insert(0, f"start: ({json.dumps(START)} think {json.dumps(END)} WS)? answer")
    return lark_spec("\n".join(rules), field)


def answer_rules(tool_grammar: GrammarSpec | None, schema: Any | None) -> str | None:
    """The `answer` rule for after_reasoning: the tool-call grammar (its `start` renamed), or a JSON schema."""
    if tool_grammar is not None:
        return tool_grammar.grammar.replace("start:", "answer:", 1)
    if schema is not None:
        layout = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        body = {**schema, "x-guidance": layout} if isinstance(schema, dict) else schema
        return f"answer: %json {json.dumps(body)}"
    return None
