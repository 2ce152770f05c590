"""Plain-torch reference of the batched LoRA update (engine/kernels/lora.py): y + B_i (A_i x) per token, in float64."""
from __future__ import annotations

import torch


def lora_reference(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   token_indices: torch.Tensor) -> torch.Tensor:
    """A new float64 tensor: y[t] + b[i-1] @ (a[i-1] @ x[t]) where i = token_indices[t] > 0, else y[t].

    x [T, in], y [T, out], a [N, R, in], b [N, out, R], token_indices [T] (0 = no adapter).
    """
    out = y.double().clone()
    for t, index in enumerate(token_indices.tolist()):
        if index:
            out[t] += b[index - 1].double() @ (a[index - 1].double() @ x[t].double())
    return out
