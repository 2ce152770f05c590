"""M-RoPE positions (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): three rotary positions per token, (time, height, width).

A text token has the same position in all three sections, one more than the token before. An image's tokens take
its merged patch grid: (start, start + row, start + column), where `start` is the position after the text before
it, and the text after the image goes on from start + max(rows, columns). A prompt with images therefore ends at a
position below its length, and every later token (generated, or the prompt's text after its last image) sits at
its flat position in the paged cache plus the prompt's `delta` (negative or zero), the same in all three sections.
The engine keeps flat positions for the cache (slots, prefix blocks); only the model's rotary sees these.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.batch import SeqSpan

MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")  # their images follow these rules (transformers: get_rope_index)


def prompt_positions(token_ids: list[int], image_token_id: int, image_grid_thw: torch.Tensor,
                     merge_size: int) -> tuple[torch.Tensor, int]:
    """([3, prompt tokens] positions, delta) of a prompt whose images, in order, have grids `image_grid_thw`
    [images, 3] (time, height, width in patches; `merge_size` x `merge_size` patches make one token)."""
    positions = torch.empty(3, len(token_ids), dtype=torch.int64)
    index = next_position = 0      # the first token not placed yet, and its position were it text
    for t, h, w in (image_grid_thw // torch.tensor([1, merge_size, merge_size])).tolist():
        try:
            start = token_ids.index(image_token_id, index)
        except ValueError:
            raise ValueError(f"the prompt has fewer image token runs than its {len(image_grid_thw)} images") from None
        positions[:, index:start] = torch.arange(start - index) + next_position
        next_position += start - index
        index = start + t * h * w
        if token_ids[start:index] != [image_token_id] * (t * h * w):
            raise ValueError(f"an image of {t * h * w} tokens does not match the prompt's image tokens")
        grid = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        positions[:, start:index] = torch.stack(grid).reshape(3, -1) + next_position
        next_position += max(h, w)
    positions[:, index:] = torch.arange(len(token_ids) - index) + next_position
    return positions, next_position - index


def step_positions(spans: Sequence[SeqSpan], flat: torch.Tensor) -> torch.Tensor:
    """The step's positions for the model: `flat` [tokens] when no span needs M-RoPE, else [3, tokens]."""
    if all(span.rope_delta == 0 and getattr(span.images, "rope_positions", None) is None for span in spans):
        return flat
    parts = []
    for span in spans:
        start, end = span.start_pos, span.start_pos + len(span.token_ids)
        table = getattr(span.images, "rope_positions", None)
        known = 0 if table is None else max(0, min(end, table.shape[1]) - start)  # rows the prompt's table holds
        if known:
            parts.append(table[:, start:start + known])
        parts.append((torch.arange(start + known, end) + span.rope_delta).expand(3, -1))
    return torch.cat(parts, dim=1).to(flat.device)
