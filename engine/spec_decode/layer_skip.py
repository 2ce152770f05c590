"""Layer-skip self-speculation (`--speculative-layers K`): the target's first K layers, final norm and LM head.

The draft shares the target's paged KV cache: for a drafted token, layers < K get the same input and weights
in the draft as in the verification forward, so the K/V the draft writes is the K/V the target then rewrites
in the same slots, and accepted tokens need no second copy. Rejected tokens' slots lie past the sequence's
computed tokens: the block manager frees their tail blocks and the next step overwrites the rest.
"""
from __future__ import annotations

from typing import Any

import torch


def check_layer_skip(model: Any, num_layers: int, num_hidden_layers: int) -> None:
    """Raise ValueError when `model` cannot draft with its first `num_layers` layers."""
    if not 1 <= num_layers < num_hidden_layers:
        raise ValueError(f"--speculative-layers {num_layers}: use 1 to {num_hidden_layers - 1} "
                         f"(the model has {num_hidden_layers} layers)")
    inner = getattr(model, "model", None)
    if not all(hasattr(inner, name) for name in ("embed", "layers", "norm")) or not hasattr(model, "compute_logits"):
        raise ValueError(f"--speculative-layers is not supported for {type(model).__name__} "
                         "(it needs the generic decoder's embed, layers and final norm)")


def forward_first_layers(model: Any, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any,
                         num_layers: int) -> torch.Tensor:
    """Hidden states after the embeddings, layers 0..num_layers-1 and the final norm: [T, hidden]."""
    inner = model.model
    hidden_states, residual = inner.embed(input_ids, positions), None
    for i in range(num_layers):
        hidden_states, residual = inner.layers[i](positions, hidden_states, residual, meta)
    hidden_states, _ = inner.norm(hidden_states, residual)
    return hidden_states
