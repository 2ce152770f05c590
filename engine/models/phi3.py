"""Phi-3 / Phi-4: a Llama-shaped decoder whose checkpoint stores q/k/v as one `qkv_proj` and gate/up as
one `gate_up_proj` (split on load, so each rank still reads only its heads), with LongRoPE scaling and
partial rotary in the config.

LongRoPE: a position below original_max_position_embeddings uses the short factors, from it on the long
ones (engine/layers/rotary_embedding.py), like transformers' step-by-step forward over its cache. Two
places differ from transformers' `generate`: a prompt longer than the original context keeps short factors
for its first positions (transformers uses long ones for all), and at the crossing transformers recomputes
the whole cache with long factors while the engine keeps the keys it has.
"""
from __future__ import annotations

from engine.models.decoder import DecoderForCausalLM


class Phi3ForCausalLM(DecoderForCausalLM):
    fused_checkpoint = True
