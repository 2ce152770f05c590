"""Image tokens that attend to each other both ways (Gemma 3): a causal mask widened inside each image.

transformers builds Gemma 3's mask as causal OR (same image run), and for sliding-window layers
window AND (causal OR same run), where the window keeps keys after key > query - window: later keys of a query's
own run are always visible, earlier ones as causal attention sees them. So a prefill chunk's mask is its causal
(windowed) mask plus, for each query inside a run, the run's keys after it. The scheduler never ends a chunk
inside a run (engine/multimodal/prompt.py), so those keys are in the chunk.

The step's AttentionMetadata.bidirectional names the spans with such runs. The portable backend runs them as
prefill chunks (never batched with the decodes) with widened masks, and cpu_paged sends them through the same
SDPA chunks (`AttentionBackend.supports_bidirectional_images`); on other backends (Triton, flash-attn) a step
that has such spans runs on the portable backend (engine/model_inputs.py, engine/layers/attention.py).
"""
from __future__ import annotations

import torch


def widen(mask: torch.Tensor, runs: list[tuple[int, int]], start_pos: int) -> torch.Tensor:
    """mask [Q, K] bool of queries at positions start_pos.. over keys 0..K-1, plus each query's later keys in
    its own run [start, end) of `runs`."""
    num_queries, num_keys = mask.shape
    query_pos = torch.arange(num_queries, device=mask.device)[:, None] + start_pos
    key_pos = torch.arange(num_keys, device=mask.device)[None, :]
    mask = mask.clone()
    for start, end in runs:
        assert end <= num_keys, (start, end, num_keys)  # the scheduler keeps a run in one chunk
        inside = (query_pos >= start) & (query_pos < end)
        mask |= inside & (key_pos > query_pos) & (key_pos < end)
    return mask
