"""sentence-transformers' poolings (models/Pooling.py) over a right-padded batch: hidden [B, L, H], mask [B, L]."""
from __future__ import annotations

import torch


def pool(mode: str, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One vector per sequence; `mask` is 1 on real tokens, and padding sits on the right."""
    if mode == "cls":
        return hidden[:, 0]
    if mode == "lasttoken":
        last = mask.sum(dim=1).long() - 1
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    m = mask.unsqueeze(-1).to(hidden.dtype)
    if mode == "max":
        return hidden.masked_fill(m == 0, -1e9).max(dim=1).values
    total = (hidden * m).sum(dim=1)
    count = m.sum(dim=1).clamp(min=1e-9)
    if mode == "mean":
        return total / count
    if mode == "mean_sqrt_len_tokens":
        return total / count.sqrt()
    raise ValueError(f"unknown pooling mode {mode!r}")


def normalize(vectors: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(vectors, p=2, dim=-1)
