"""Phi-3 / Phi-4: a Llama-shaped decoder whose checkpoint stores q/k/v as one `qkv_proj` and gate/up as
one `gate_up_proj` (split on load, so each rank still reads only its heads), with LongRoPE scaling and
partial rotary in the config."""
from __future__ import annotations

from engine.models.decoder import DecoderForCausalLM


class Phi3ForCausalLM(DecoderForCausalLM):
    fused_checkpoint = True
