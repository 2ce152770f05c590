"""Wire types of Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens): the subset we serve.

Content blocks stay plain dicts here, checked by engine.server.messages with a 422 naming the block, so that a
block type this server does not serve (image, document, ...) is refused by name rather than by a schema error.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from engine.server.protocol import _Wire

ContentBlocks = list[dict[str, Any]]


class AnthropicMessage(_Wire):
    role: Literal["user", "assistant"]
    content: str | ContentBlocks


class AnthropicTool(_Wire):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})


class CountTokensRequest(_Wire):
    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | ContentBlocks | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    metadata: dict[str, Any] | None = None


class AnthropicUsage(_Wire):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int | None = None
    cache_read_input_tokens: int | None = None


class MessagesResponse(_Wire):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: ContentBlocks
    stop_reason: str | None
    stop_sequence: str | None = None
    usage: AnthropicUsage


class MessageStreamEvent(_Wire):
    """One event of the stream: message_start, content_block_start/_delta/_stop, message_delta, message_stop,
    ping or error; the SSE `event:` line repeats `type`."""

    type: str


class CountTokensResponse(_Wire):
    input_tokens: int


class AnthropicErrorDetail(_Wire):
    type: str
    message: str


class AnthropicErrorResponse(_Wire):
    """Anthropic's error body, which its clients read (`error.type`, `error.message`); the HTTP status is the
    server's usual one (422 for a request it refuses)."""

    type: Literal["error"] = "error"
    error: AnthropicErrorDetail
