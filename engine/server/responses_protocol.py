"""Wire types of OpenAI's Responses API (POST /v1/responses): the subset we serve. Input and output items stay
plain dicts, checked by engine.server.responses with a 422 naming the item, so that an unsupported item or tool
(images, files, built-in tools) is refused by name."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from engine.server.protocol import MAX_SEED, _Wire


class ResponsesRequest(_Wire):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)     # not OpenAI's; as on chat completions
    stream: bool = False
    store: bool = True
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None
    user: str | None = None
    include: list[str] | None = None
    # refused when set (422 naming the field)
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None


class InputTokensDetails(_Wire):
    cached_tokens: int = 0


class OutputTokensDetails(_Wire):
    reasoning_tokens: int = 0


class ResponseUsage(_Wire):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class ResponseObject(_Wire):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "in_progress"]
    model: str
    output: list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    incomplete_details: dict[str, str] | None = None
    error: dict[str, Any] | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = False
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    store: bool = True
    usage: ResponseUsage | None = None


class ResponseStreamEvent(_Wire):
    """One typed event (response.created, response.output_text.delta, response.completed, ...); the SSE
    `event:` line repeats `type`."""

    type: str
    sequence_number: int
