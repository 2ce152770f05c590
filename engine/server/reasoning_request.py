"""How each API asks a reasoning model to think, turned into the chat request's switches, and the request's grammar
with the reasoning span in front of it (engine.server.reasoning).

| API | field | becomes |
|---|---|---|
| chat completions | `max_reasoning_tokens`, `chat_template_kwargs` (`enable_thinking`) | themselves |
| Anthropic Messages | `thinking: {"type": "enabled", "budget_tokens": N}` / `{"type": "disabled"}` | budget N / `enable_thinking: false` |
| Responses | `reasoning: {"effort": "none" / "minimal" / "low" / "medium" / "high"}`, or `{"max_tokens": N}` | `enable_thinking: false` / budgets 1024, 4096, none and `reasoning_effort` to the template / budget N |

A budget closes the span at that many tokens (the grammar then allows only its end). Thinking off reaches the
template as `enable_thinking: false` (Qwen3's switch); a template that opens the span itself (the R1 distills)
still thinks, within the budget asked. Asking a model without a reasoning parser to think is a 422. gpt-oss's
budget bounds its analysis message (engine.server.harmony).
"""
from __future__ import annotations

from typing import Any

from engine.server.errors import ValidationError
from engine.server.grammar import response_format_schema
from engine.server.harmony import final_grammar
from engine.server.protocol import ChatCompletionRequest
from engine.server.reasoning import ReasoningFormat, after_reasoning, answer_rules, for_prompt
from engine.server.tools import ToolUse
from engine.structured.spec import GrammarError, GrammarSpec

EFFORT_BUDGETS: dict[str, int | None] = {"low": 1024, "medium": 4096, "high": None}
_NO_PARSER = "this model has no reasoning parser (see --reasoning-parser)"


def request_grammar(req: ChatCompletionRequest, thinks: ReasoningFormat | None, use: ToolUse | None,
                    response_format: GrammarSpec | None, prompt: str | None = None,
                    tokenizer: Any = None) -> GrammarSpec | None:
    """The request's grammar (tool calls, else response_format); for a reasoning model it starts after the
    reasoning span, which `max_reasoning_tokens` bounds (none where the rendered `prompt` closed the span).
    gpt-oss's grammars are harmony messages, their markers forced as the special tokens of `tokenizer`."""
    grammar = use.grammar if use is not None else response_format
    budget = req.max_reasoning_tokens
    if budget is not None and thinks is None:
        raise ValidationError(f"`max_reasoning_tokens` needs a reasoning model; {_NO_PARSER}")
    if thinks is not None and thinks.name == "gpt_oss":
        return _harmony_grammar(req, use, response_format, tokenizer)
    if prompt is not None:
        thinks = for_prompt(thinks, prompt)
    if thinks is None or (budget is None and grammar is None):
        return grammar
    answer = answer_rules(use.grammar if use is not None else None, response_format_schema(req.response_format))
    if answer is None and grammar is not None:
        return grammar      # a regex: from the first token, as without reasoning
    try:
        return after_reasoning(thinks, answer, budget, "response_format" if use is None else "tools")
    except GrammarError as exc:
        raise ValidationError(str(exc)) from None


def _harmony_grammar(req: ChatCompletionRequest, use: ToolUse | None, response_format: GrammarSpec | None,
                     tokenizer: Any) -> GrammarSpec | None:
    """gpt-oss: an analysis message within the budget, then the final message under response_format (tool calls:
    engine.server.tools built their harmony grammar with the budget already)."""
    budget = req.max_reasoning_tokens
    if use is not None or (budget is None and response_format is None):
        return use.grammar if use is not None else None
    answer = answer_rules(None, response_format_schema(req.response_format))
    if answer is None and response_format is not None:
        return response_format      # a regex: from the first token, as without reasoning
    try:
        return final_grammar(answer, budget, tokenizer, "response_format")
    except GrammarError as exc:
        raise ValidationError(str(exc)) from None


def anthropic_thinking(thinking: dict[str, Any] | None, thinks: ReasoningFormat | None) -> dict[str, Any]:
    """Anthropic's `thinking` -> chat request fields."""
    if thinking is None:
        return {}
    kind = thinking.get("type")
    if kind == "disabled":
        return {"chat_template_kwargs": {"enable_thinking": False}}
    if kind != "enabled":
        raise ValidationError('`thinking.type` must be "enabled" or "disabled"')
    if thinks is None:
        raise ValidationError(f"`thinking` is not supported for this model: {_NO_PARSER}")
    budget = thinking.get("budget_tokens")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValidationError("`thinking.budget_tokens` must be a positive integer")
    return {"max_reasoning_tokens": budget}


def responses_reasoning(reasoning: dict[str, Any] | None, thinks: ReasoningFormat | None) -> dict[str, Any]:
    """Responses' `reasoning` -> chat request fields (`summary` and the rest are accepted and ignored)."""
    if not reasoning:
        return {}
    effort, budget = reasoning.get("effort"), reasoning.get("max_tokens")
    if effort in ("none", "minimal") and budget is None:
        return {"chat_template_kwargs": {"enable_thinking": False}}
    if effort is not None and effort not in EFFORT_BUDGETS:
        raise ValidationError('`reasoning.effort` must be "none", "minimal", "low", "medium" or "high"')
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
        raise ValidationError("`reasoning.max_tokens` must be a positive integer")
    if effort is None and budget is None:
        return {}
    if thinks is None:
        raise ValidationError(f"`reasoning` is not supported for this model: {_NO_PARSER}")
    # gpt-oss's template writes the effort into its system message ("Reasoning: low"); other templates ignore it
    fields: dict[str, Any] = {} if effort is None else {"chat_template_kwargs": {"reasoning_effort": effort}}
    budget = budget if budget is not None else EFFORT_BUDGETS[effort]
    return fields if budget is None else {**fields, "max_reasoning_tokens": budget}
