"""Sizes of large models whose config.json a dry run from a laptop cannot read, from their model cards.

Parameters are in billions: `total_b` must sit in GPU memory (every expert of a mixture-of-experts model),
`active_b` is what one token runs through (compute, not memory). The layer and KV-head counts size the KV
cache (tgi_hpc/models/footprint.py). Each entry cites the page its numbers come from; the layer shapes come
from the model's config.json on the Hub where the card does not give them.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KnownModel:
    total_b: float
    active_b: float
    num_layers: int
    num_kv_heads: int
    head_dim: int
    source: str


KNOWN_MODELS: dict[str, KnownModel] = {
    # "46.7B total parameters but only uses 12.9B parameters per token"; 32 layers, 8 KV heads of 128
    "mistralai/Mixtral-8x7B-v0.1": KnownModel(46.7, 12.9, 32, 8, 128, "https://mistral.ai/news/mixtral-of-experts"),
    "mistralai/Mixtral-8x7B-Instruct-v0.1": KnownModel(46.7, 12.9, 32, 8, 128,
                                                       "https://mistral.ai/news/mixtral-of-experts"),
    # "uses only 39B active parameters out of 141B"; 56 layers, 8 KV heads of 128
    "mistralai/Mixtral-8x22B-v0.1": KnownModel(141, 39, 56, 8, 128, "https://mistral.ai/news/mixtral-8x22b"),
    "mistralai/Mixtral-8x22B-Instruct-v0.1": KnownModel(141, 39, 56, 8, 128, "https://mistral.ai/news/mixtral-8x22b"),
    # model card: "30.5B in total and 3.3B activated", 48 layers, 32 Q / 4 KV heads (head_dim 128)
    "Qwen/Qwen3-30B-A3B": KnownModel(30.5, 3.3, 48, 4, 128, "https://huggingface.co/Qwen/Qwen3-30B-A3B"),
    # model card: "235B in total and 22B activated", 94 layers, 64 Q / 4 KV heads (head_dim 128)
    "Qwen/Qwen3-235B-A22B": KnownModel(235, 22, 94, 4, 128, "https://huggingface.co/Qwen/Qwen3-235B-A22B"),
    # model card: 405B parameters; 126 layers, 8 KV heads of 128 (The Llama 3 Herd of Models, Table 3)
    "meta-llama/Llama-3.1-405B": KnownModel(405, 405, 126, 8, 128, "https://huggingface.co/meta-llama/Llama-3.1-405B"),
    "meta-llama/Llama-3.1-405B-Instruct": KnownModel(405, 405, 126, 8, 128,
                                                     "https://huggingface.co/meta-llama/Llama-3.1-405B-Instruct"),
    # model card: 70B; 80 layers, 8 KV heads of 128 (same paper, Table 3)
    "meta-llama/Llama-3.1-70B-Instruct": KnownModel(70, 70, 80, 8, 128,
                                                    "https://huggingface.co/meta-llama/Llama-3.1-70B-Instruct"),
    # model card: 8B; 32 layers, 8 KV heads of 128
    "meta-llama/Llama-3.1-8B-Instruct": KnownModel(8, 8, 32, 8, 128,
                                                   "https://huggingface.co/meta-llama/Llama-3.1-8B-Instruct"),
}


def known_model(model: str) -> KnownModel | None:
    """By Hub id (case-insensitive); a local directory matches by its last two path parts."""
    key = "/".join(model.rstrip("/").split("/")[-2:]).lower()
    return next((entry for name, entry in KNOWN_MODELS.items() if name.lower() == key), None)
