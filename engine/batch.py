"""The unit of work the scheduler hands the model runner: spans of tokens per sequence."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal


@dataclass(slots=True)
class SeqSpan:
    """Run `token_ids` for one sequence whose first `start_pos` tokens are already in the KV cache.

    Prefill is a span starting at 0, a prefill chunk starts later, decode is a span of one token.
    The runner writes the span's K/V into the slots given by `block_table` and returns logits
    for the last token ("last"), every token ("all", for prefill logprobs) or nothing ("none",
    an unfinished prefill chunk). Its tokens go through LoRA adapter `adapter` (0 = none).
    """

    seq_id: int
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    logits: Literal["none", "last", "all"] = "last"
    adapter: int = 0            # LoRA adapter index (engine/lora), 0 = the base model
    table_version: int = -1     # Sequence.block_table_version; -1: unknown (engine/attention/block_tables.py)
    images: Any = None          # engine.multimodal.MultiModalPrompt while the span's prefill has image tokens left
    rope_delta: int = 0         # M-RoPE: added to the positions of tokens past the prompt's images (multimodal/mrope)


def probe_decode_spans(lengths: list[int], block_size: int, first_token: int) -> tuple[list[SeqSpan], int]:
    """Decode spans (one new token each, `first_token` + i) of sequences of `lengths` tokens over the first
    blocks of the cache, one after another: the start-up checks of a decode path against the eager forward.
    Returns the spans and how many blocks they use."""
    spans, next_block = [], 0
    for seq_id, length in enumerate(lengths):
        blocks = list(range(next_block, next_block + -(-length // block_size)))
        next_block += len(blocks)
        spans.append(SeqSpan(seq_id, [first_token + seq_id], length - 1, blocks))
    return spans, next_block
