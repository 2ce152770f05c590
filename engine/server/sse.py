"""Server-sent events framing: TGI's `data:{json}\\n\\n` and OpenAI's `data: {json}\\n\\n` + `[DONE]`."""
from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

from engine.server.errors import ServerError

MEDIA_TYPE = "text/event-stream"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = b"data: [DONE]\n\n"


def encode_event(data: dict[str, Any], *, space: bool = False) -> bytes:
    """One event; `space=True` is OpenAI's framing (huggingface_hub matches "data: [DONE]" exactly)."""
    sep = "data: " if space else "data:"
    return f"{sep}{json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()


def encode_model(model: BaseModel, *, exclude: set[str] | None = None, space: bool = False) -> bytes:
    """One event from a wire model, serialized by pydantic-core straight to JSON bytes: the per-token path of
    a stream (about 7x cheaper than `encode_event(dump(model))`, which builds a dict, walks it, then json.dumps
    it). Non-finite floats become null, as serde_json (TGI) writes them."""
    sep = b"data: " if space else b"data:"
    return sep + model.__pydantic_serializer__.to_json(model, exclude=exclude) + b"\n\n"


def encode_error(err: ServerError, *, space: bool = False) -> bytes:
    """The final event of a stream that failed after it started."""
    return encode_event(err.body(), space=space)
