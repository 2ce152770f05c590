"""StarCoder2: LayerNorm with bias, biases on every projection, a plain GELU MLP (c_fc -> c_proj),
sliding-window attention."""
from __future__ import annotations

from engine.models.decoder import DecoderForCausalLM


class Starcoder2ForCausalLM(DecoderForCausalLM):
    checkpoint_renames = ((r"\.mlp\.c_fc\.", ".mlp.up_proj."), (r"\.mlp\.c_proj\.", ".mlp.down_proj."))
