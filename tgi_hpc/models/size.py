"""Estimate a model's size (billions of parameters) from config.json, or from its name."""
from __future__ import annotations

import re

_NAME_SIZE = re.compile(r"(?<![0-9.])(\d+(?:\.\d+)?)\s*([bBmM])(?![a-zA-Z])")


def params_from_config(config: dict) -> float:
    text = config.get("text_config", config)
    hidden = int(text["hidden_size"])
    layers = int(text["num_hidden_layers"])
    inter = int(text.get("intermediate_size", 4 * hidden))
    vocab = int(text.get("vocab_size", 32000))
    heads = int(text.get("num_attention_heads", 1))
    kv_heads = int(text.get("num_key_value_heads", heads))
    head_dim = int(text.get("head_dim") or hidden // heads)
    attn = hidden * head_dim * (heads * 2 + kv_heads * 2)
    mlp = 3 * hidden * inter
    embed = vocab * hidden * (1 if text.get("tie_word_embeddings") else 2)
    return (layers * (attn + mlp) + embed) / 1e9


def estimate_params_b(model: str, config: dict | None) -> float | None:
    """From the snapshot's config.json when we have it, else from a name like 'Llama-3.1-8B'."""
    if config is not None:
        try:
            return params_from_config(config)
        except (KeyError, ValueError, TypeError):
            pass
    sizes = [float(n) / (1000 if unit in "mM" else 1) for n, unit in _NAME_SIZE.findall(model.split("/")[-1])]
    return max(sizes) if sizes else None
