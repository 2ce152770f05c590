"""Packed variable-length forwards for transformers' model classes: no padding anywhere.

A batch of sequences is concatenated into one row [1, T] with each sequence's own position ids, and the
attention function registered here (under ATTN_IMPLEMENTATION, in transformers' AttentionInterface) runs
SDPA on each sequence's slice alone, so no token attends across a boundary and none is padding: the
linears, norms and activations (most of an encoder's time) see only real tokens. The slices reach the
attention as the forward kwarg `tgi_varlen` (a list of (start, end)). Without that kwarg the function is plain
SDPA with SDPA's mask (registered for it too), so a padded batch runs right on the same model.

A sliding window (ModernBERT's local layers, Mistral's causal one) becomes a band within each sequence. Whether a model class honours all this (explicit position ids, every attention
through the interface) is not assumed: `self_check` compares a packed forward with the padded SDPA one on random
sequences at load, and the runner keeps padded batches when they differ or the packed forward raises.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "tgi_varlen"
_ROBERTA_LIKE = ("roberta", "xlm-roberta", "camembert")  # positions count from padding_idx + 1


def varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """query [1, H, T, d], key/value [1, KV, T, d] -> ([1, T, H, d], None), one SDPA per sequence slice."""
    bounds = kwargs.get("tgi_varlen")
    if bounds is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if causal is None else causal)
    window = kwargs.get("sliding_window")  # ModernBERT: |q - k| < window; Mistral-style causal: 0 <= q - k < window
    gqa = key.shape[1] != query.shape[1]
    out = torch.empty_like(query)
    for start, end in bounds:
        band = None
        if window is not None and end - start > window - 1:
            pos = torch.arange(end - start, device=query.device)
            dist = pos[:, None] - pos[None, :]
            band = (dist >= 0) & (dist < window) if causal else dist.abs() < window
        out[:, :, start:end] = F.scaled_dot_product_attention(
            query[:, :, start:end], key[:, :, start:end], value[:, :, start:end], attn_mask=band,
            is_causal=causal and band is None, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2), None


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    AttentionInterface.register(ATTN_IMPLEMENTATION, varlen_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


def packed_inputs(seqs: list[list[int]], model_type: str, pad_token_id: int,
                  device: torch.device) -> tuple[dict[str, Any], torch.Tensor]:
    """The forward's kwargs for one packed row, and the sequences' lengths."""
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.long)
    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long).unsqueeze(0)
    positions = torch.cat([torch.arange(n) for n in lengths.tolist()]).unsqueeze(0)
    if model_type in _ROBERTA_LIKE:
        positions = positions + pad_token_id + 1
    ends = lengths.cumsum(0).tolist()
    bounds = list(zip([0, *ends[:-1]], ends))
    return {"input_ids": ids.to(device), "position_ids": positions.to(device), "tgi_varlen": bounds}, lengths


def set_implementation(model: torch.nn.Module, name: str) -> None:
    """Switch the attention of every submodule config (transformers reads config._attn_implementation per call)."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            config._attn_implementation = name


def self_check(packed_forward, padded_forward, vocab_size: int, max_len: int, special_ids: list[int]) -> str | None:
    """None when a packed forward of a few random sequences equals the padded one; else why not."""
    gen = torch.Generator().manual_seed(0)
    lengths = [n for n in (3, min(40, max_len), max_len, 1) if n >= 1]
    low = max(special_ids, default=-1) + 1 if max(special_ids, default=-1) + 8 < vocab_size else 0
    seqs = [torch.randint(low, vocab_size, (n,), generator=gen).tolist() for n in lengths]
    try:
        want = padded_forward(seqs)  # first: the packed one switches the model's attention
        got = packed_forward(seqs)
    except Exception as exc:  # noqa: BLE001 - any failure means: use padded batches
        return f"{type(exc).__name__}: {exc}"
    scale = float(want.abs().max()) or 1.0
    diff = float((got - want).abs().max())
    tolerance = 1e-4 if want.dtype == torch.float32 else 2e-2
    return None if diff <= tolerance * scale else f"packed and padded outputs differ by {diff:.3g}"
