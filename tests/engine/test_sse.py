"""The per-token SSE fast path writes exactly the bytes of the generic one (dict, TGI's omissions, json.dumps)."""
from __future__ import annotations

import json

import pytest

from engine.server import sse
from engine.server.protocol import StreamDetails, StreamResponse, Token, dump

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
    fast = sse.encode_model(model, exclude=None if model.top_tokens else {"top_tokens"})
    generic = sse.encode_event(dump(model))
    assert json.loads(fast[len(b"data:"):]) == json.loads(generic[len(b"data:"):])
    assert fast.startswith(b"data:{") and fast.endswith(b"}\n\n") and b"\n" not in fast[:-2]
    assert ("top_tokens" in json.loads(fast[5:])) == bool(top)


def test_a_non_finite_logprob_is_null_not_invalid_json() -> None:
    model = StreamResponse(index=1, token=Token(id=1, text="x", logprob=float("-inf"), special=False))
    body = json.loads(sse.encode_model(model, exclude={"top_tokens"})[5:])
    assert body["token"]["logprob"] is None
