"""Gemma 2 and Gemma 3 (text): the decoder with Gemma's knobs, all read from config.json by ModelConfig.

(1 + w) RMSNorm, a norm before and after each block, embeddings scaled by sqrt(hidden_size), GELU-tanh
gated MLP, attention scale query_pre_attn_scalar ** -0.5, sliding and global layers alternating;
Gemma 2 soft-caps attention and final logits, Gemma 3 norms q and k per head and gives its sliding
layers their own RoPE base. The checkpoint names are the engine's own.
"""
from __future__ import annotations

from engine.models.decoder import DecoderForCausalLM


class Gemma2ForCausalLM(DecoderForCausalLM):
    pass


class Gemma3ForCausalLM(DecoderForCausalLM):
    pass
