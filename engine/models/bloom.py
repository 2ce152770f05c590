"""BLOOM: ALiBi instead of position embeddings (engine/attention/alibi.py), a LayerNorm after the token
embeddings, biases everywhere, a tanh-GELU MLP (engine/model_config.py) and Falcon's checkpoint layout (one
`query_key_value` per layer, grouped per head)."""
from __future__ import annotations

from engine.models.falcon import FalconForCausalLM


class BloomForCausalLM(FalconForCausalLM):
    pass
