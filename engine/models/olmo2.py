"""OLMo 2: the decoder with norms after each block instead of before ("post" layout) and RMSNorm on q
and k over all heads at once (split across tensor-parallel ranks by ShardedRMSNorm)."""
from __future__ import annotations

from engine.models.decoder import DecoderForCausalLM


class Olmo2ForCausalLM(DecoderForCausalLM):
    pass
