"""The per-token SSE fast path (pydantic-core straight to bytes) writes what the generic one (dict, TGI's and OpenAI's
omissions, json.dumps) writes, for TGI's stream events and OpenAI's completion and chat chunks."""
from __future__ import annotations

import json

import pytest

from engine.server import sse
from engine.server.protocol import (ChatChunkChoice, ChatCompletionChunk, ChatDelta, ChatLogprob, ChatLogprobs,
                                    Completion, CompletionChoice, StreamDetails, StreamResponse, Token, Usage, dump)

TOKENS = [Token(id=5, text=" the", logprob=-0.25, special=False),
          Token(id=0, text="é\u2028\"\\\n</s>", logprob=None, special=True),   # JSON escapes, non-ASCII kept
          Token(id=2**31 - 1, text="", logprob=-1e-300, special=False)]


@pytest.mark.parametrize("token", TOKENS)
@pytest.mark.parametrize("top", [[], [Token(id=1, text="a", logprob=-3.5, special=False)]])
@pytest.mark.parametrize("end", [False, True])
def test_encode_model_is_the_generic_encoding(token: Token, top: list[Token], end: bool) -> None:
    details = StreamDetails(finish_reason="length", generated_tokens=7, seed=None, input_length=3) if end else None
    model = StreamResponse(index=3, token=token, top_tokens=top, generated_text="done ü" if end else None,
                           details=details)
    fast = sse.encode_model(model)
    generic = sse.encode_event(dump(model))
    assert json.loads(fast[len(b"data:"):]) == json.loads(generic[len(b"data:"):])
    assert fast.startswith(b"data:{") and fast.endswith(b"}\n\n") and b"\n" not in fast[:-2]
    assert ("top_tokens" in json.loads(fast[5:])) == bool(top)


def test_a_non_finite_logprob_is_null_not_invalid_json() -> None:
    model = StreamResponse(index=1, token=Token(id=1, text="x", logprob=float("-inf"), special=False))
    body = json.loads(sse.encode_model(model)[5:])
    assert body["token"]["logprob"] is None and "top_tokens" not in body


def chat_chunk(delta: ChatDelta | None, logprob: float | None = None, usage: Usage | None = None) -> ChatCompletionChunk:
    logprobs = None if logprob is None else ChatLogprobs(content=[ChatLogprob(token="x", logprob=logprob)])
    choices = [] if delta is None else [ChatChunkChoice(index=1, delta=delta, logprobs=logprobs, finish_reason=None)]
    return ChatCompletionChunk(id="chatcmpl-1", created=1, model="m", usage=usage, system_fingerprint="fp",
                               choices=choices)


OPENAI_CHUNKS = {
    "completion": Completion(id="cmpl-1", created=1, model="m", usage=None, system_fingerprint="fp",
                             choices=[CompletionChoice(index=0, text=" é\n", logprobs=None, finish_reason=None)]),
    "completion usage": Completion(id="cmpl-1", created=1, model="m", system_fingerprint="fp", choices=[],
                                   usage=Usage(prompt_tokens=3, completion_tokens=2, total_tokens=5)),
    "content": chat_chunk(ChatDelta(content=" word")),
    "empty reasoning and calls": chat_chunk(ChatDelta(content="a", reasoning_content="", tool_calls=[])),
    "reasoning": chat_chunk(ChatDelta(content=None, reasoning_content="think")),
    "tool call": chat_chunk(ChatDelta(content=None, tool_calls=[{"index": 0, "function": {"arguments": "{\""}}])),
    "logprob": chat_chunk(ChatDelta(content="x"), logprob=-0.125),
}


@pytest.mark.parametrize("name", OPENAI_CHUNKS)
def test_openai_chunks_fast_path_is_the_generic_encoding(name: str) -> None:
    model = OPENAI_CHUNKS[name]
    fast, generic = sse.encode_model(model, space=True), sse.encode_event(dump(model), space=True)
    assert fast == generic          # the same bytes: OpenAI's framing, key order, omissions, escapes
    body = json.loads(fast[len(b"data: "):])
    for choice in body["choices"]:  # chat: empty reasoning/tool calls are left out, an explicit null content is kept
        if "delta" not in choice:
            continue
        assert {"reasoning_content", "tool_calls"} & choice["delta"].keys() <= {k for k, v in choice["delta"].items() if v}
        assert "content" in choice["delta"]
