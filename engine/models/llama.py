"""Llama family: Llama 2/3/3.1/3.2, Mistral (sliding window), Qwen2 (qkv bias), Qwen3 (q/k norm per head).

The generic decoder of engine/models/decoder.py with its default knobs; every difference between these
models (biases, windows, q/k norms, RoPE scaling, tied embeddings) is read from config.json by ModelConfig.
"""
from __future__ import annotations

from engine.models.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    pass
