"""The legacy /v1/completions `logprobs` object: tokens, token_logprobs, top_logprobs, text_offset.

A token's text is what it adds to the decoded text (leading space included), found by decoding a
short window before it: decoding one token alone drops SentencePiece's leading space.
"""
from __future__ import annotations

from typing import Any

from engine.outputs import TokenInfo
from engine.server.protocol import CompletionLogprobs

_WINDOW = 6  # tokens of left context; enough for multi-token characters and merged spaces


def token_pieces(tokenizer: Any, ids: list[int], first: int) -> list[str]:
    """The text each of `ids[first:]` adds when `ids` is decoded (special tokens add nothing)."""
    pieces = []
    for i in range(first, len(ids)):
        lo = max(0, i - _WINDOW)
        before = tokenizer.decode(ids[lo:i], skip_special_tokens=True) if i > lo else ""
        after = tokenizer.decode(ids[lo:i + 1], skip_special_tokens=True)
        pieces.append(after[len(before):])
    return pieces


def completion_logprobs(tokenizer: Any, prompt_ids: list[int], prefill: list[TokenInfo] | None,
                        generated: list[TokenInfo]) -> CompletionLogprobs:
    """One entry per token of the choice's text: the prompt's first (with echo: `prefill`, one TokenInfo per
    prompt token, the first without logprob), then the generated ones; offsets count from the text's start."""
    shown = (prefill or []) + generated
    ids = prompt_ids + [t.id for t in generated]
    pieces = token_pieces(tokenizer, ids, 0 if prefill is not None else len(prompt_ids))
    tokens, offsets, pos = [], [], 0
    for token, piece in zip(shown, pieces):
        tokens.append(piece or token.text)
        offsets.append(pos)
        pos += len(piece)
    first_scored = 1 if prefill is not None else 0  # the prompt's first token has nothing before it
    return CompletionLogprobs(
        tokens=tokens, text_offset=offsets,
        token_logprobs=[None if i < first_scored else t.logprob for i, t in enumerate(shown)],
        top_logprobs=[None if i < first_scored else _top(t) for i, t in enumerate(shown)])


def stream_logprobs(token: TokenInfo, text: str, offset: int) -> CompletionLogprobs:
    """One streamed token's entry; `offset` is where its text starts in the choice's text."""
    return CompletionLogprobs(tokens=[text or token.text], token_logprobs=[token.logprob],
                              top_logprobs=[_top(token)], text_offset=[offset])


def _top(token: TokenInfo) -> dict[str, float]:
    top: dict[str, float] = {}
    for alt in token.top_tokens:
        if alt.logprob is not None:
            top.setdefault(alt.text, alt.logprob)   # two ids with one text: the likelier one is listed first
    return top
