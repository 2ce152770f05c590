"""sentence-transformers' poolings (models/Pooling.py) over packed hidden states: hidden [T, H], the sequences one
after another (`lengths`), with `skips[i]` leading prompt tokens left out of sequence i's pooling
(`include_prompt: false`; 0 otherwise), as sentence-transformers does."""
from __future__ import annotations

import torch


def pool(mode: str, hidden: torch.Tensor, lengths: torch.Tensor, skips: torch.Tensor | None = None) -> torch.Tensor:
    """One vector per sequence."""
    lengths = lengths.to(hidden.device)
    skips = torch.zeros_like(lengths) if skips is None else skips.to(hidden.device)
    starts = lengths.cumsum(0) - lengths
    if mode == "cls":  # the first token after the prompt (the first token when nothing follows the prompt)
        return hidden[starts + torch.where(lengths > skips, skips, 0)]
    if mode == "lasttoken":
        return hidden[starts + lengths - 1]
    seg = torch.repeat_interleave(torch.arange(len(lengths), device=hidden.device), lengths)
    keep = torch.arange(hidden.shape[0], device=hidden.device) - starts[seg] >= skips[seg]
    rows, seg = hidden[keep], seg[keep]
    if mode == "max":
        out = torch.full((len(lengths), hidden.shape[1]), float("-inf"), dtype=hidden.dtype, device=hidden.device)
        return out.scatter_reduce(0, seg.unsqueeze(1).expand_as(rows), rows, reduce="amax")
    total = torch.zeros((len(lengths), hidden.shape[1]), dtype=torch.float32, device=hidden.device)
    total = total.index_add(0, seg, rows.float())
    count = (lengths - skips).clamp(min=0).to(torch.float32).clamp(min=1e-9).unsqueeze(1)
    if mode == "mean":
        return (total / count).to(hidden.dtype)
    if mode == "mean_sqrt_len_tokens":
        return (total / count.sqrt()).to(hidden.dtype)
    raise ValueError(f"unknown pooling mode {mode!r}")


def normalize(vectors: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(vectors, p=2, dim=-1)
