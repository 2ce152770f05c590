"""Estimate a model's size (billions of parameters) from config.json, or from its name, and the size the
profile's catalog compares (its `max_params_b` assume 2 bytes per parameter: a quantized model counts as
the bf16 model with the same weight bytes)."""
from __future__ import annotations

import re

from tgi_hpc.models.config_names import common_names
from tgi_hpc.models.quantization import linear_weight_bits

_NAME_SIZE = re.compile(r"(?<![0-9.])(\d+(?:\.\d+)?)\s*([bBmM])(?![a-zA-Z])")


def param_split(config: dict) -> tuple[float, float]:
    """(decoder linear layers, embeddings + LM head + any vision tower) in billions: only the first are ever
    quantized."""
    text = common_names(config.get("text_config", config))
    hidden = int(text["hidden_size"])
    layers = int(text["num_hidden_layers"])
    inter = int(text.get("intermediate_size", 4 * hidden))
    vocab = int(text.get("vocab_size", 32000))
    heads = int(text.get("num_attention_heads", 1))
    kv_heads = int(text.get("num_key_value_heads", heads))
    head_dim = int(text.get("head_dim") or hidden // heads)
    attn = hidden * head_dim * (heads * 2 + kv_heads * 2)
    mlp = moe_mlp_params(text)[0] if num_experts(text) else int(text.get("mlp_matrices", 3)) * hidden * inter
    embed = vocab * hidden * (1 if text.get("tie_word_embeddings") else 2)
    return layers * (attn + mlp) / 1e9, (embed + vision_params(config)) / 1e9


def vision_params(config: dict) -> int:
    """A vision-language model's vision tower (a ViT: attention 4h² and MLP 2·h·intermediate per layer, the patch
    embedding) and its projector into the text model (about h·H + H²); 0 without a vision_config."""
    vision = config.get("vision_config")
    if not isinstance(vision, dict):
        return 0
    hidden = int(vision.get("hidden_size") or vision.get("embed_dim") or 0)
    layers = int(vision.get("num_hidden_layers") or vision.get("depth") or 0)
    inter = int(vision.get("intermediate_size") or 4 * hidden)
    patch = int(vision.get("patch_size") or 14)
    text_hidden = int(config.get("text_config", {}).get("hidden_size") or hidden)
    patches = int(vision.get("num_channels") or 3) * patch ** 2 * hidden
    tower = layers * (4 * hidden * hidden + 2 * hidden * inter) + patches
    return tower + hidden * text_hidden + text_hidden * text_hidden if tower else 0


def num_experts(text: dict) -> int:
    """Experts per MoE layer: Mixtral's num_local_experts, Qwen-MoE's num_experts; 0 for a dense model."""
    return int(text.get("num_local_experts") or text.get("num_experts") or 0)


def moe_mlp_params(text: dict) -> tuple[int, int]:
    """(all, active per token) parameters of one MoE layer's MLP: experts, router and shared expert."""
    hidden = int(text["hidden_size"])
    expert = int(text.get("moe_intermediate_size") or text["intermediate_size"])  # Mixtral: intermediate_size
    shared = int(text.get("shared_expert_intermediate_size") or 0)
    experts, top_k = num_experts(text), int(text.get("num_experts_per_tok", 2))
    common = hidden * experts + 3 * hidden * shared + (hidden if shared else 0)  # router, shared expert + gate
    return experts * 3 * hidden * expert + common, top_k * 3 * hidden * expert + common


def active_params_b(config: dict) -> float:
    """Parameters one token runs through, in billions (all of them for a dense model)."""
    text = config.get("text_config", config)
    linear, other = param_split(config)
    if not num_experts(text):
        return linear + other
    every, active = moe_mlp_params(text)
    return linear + other - int(text["num_hidden_layers"]) * (every - active) / 1e9


def params_from_config(config: dict) -> float:
    return sum(param_split(config))


def estimate_params_b(model: str, config: dict | None) -> float | None:
    """From the snapshot's config.json when we have it, else from a name like 'Llama-3.1-8B'."""
    if config is not None:
        try:
            return params_from_config(config)
        except (KeyError, ValueError, TypeError):
            pass
    sizes = [float(n) / (1000 if unit in "mM" else 1) for n, unit in _NAME_SIZE.findall(model.split("/")[-1])]
    return max(sizes) if sizes else None


def catalog_size_b(model: str, config: dict | None, quantize: str | None = None) -> float | None:
    """Weight bytes / 2e9: a 70B GPTQ int4 checkpoint (40 GB: int4 decoder layers, fp16 embeddings and LM
    head) counts as 20B. The quantization is the checkpoint's own (config.json) or `quantize` (formats made
    at load); without a config.json the whole name-estimated size is scaled."""
    bits = linear_weight_bits(config, quantize)
    if config is not None:
        try:
            linear, other = param_split(config)
            return linear * bits / 16 + other
        except (KeyError, ValueError, TypeError):
            pass
    size = estimate_params_b(model, None)
    return None if size is None else size * bits / 16
