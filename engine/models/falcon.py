"""Falcon: LayerNorm, a plain GELU MLP and one fused `query_key_value` grouped per KV head (split on load).
Its generations differ in the config only (engine/model_config.py `_falcon`): RW uses ALiBi and one block after
the other; 7B multi-query attention beside the MLP over one norm; 40B/180B grouped KV heads and a norm per side.
BLOOM (engine/models/bloom.py) shares the checkpoint layout."""
from __future__ import annotations

from engine.model_config import ModelConfig
from engine.models.checkpoint import CheckpointLayout
from engine.models.decoder import DecoderForCausalLM

_LAYER = r"^(?:transformer\.)?h\.(\d+)\."


class FalconForCausalLM(DecoderForCausalLM):
    checkpoint_renames = (
        (r"^(?:transformer\.)?word_embeddings\.", "model.embed_tokens."),
        (r"^(?:transformer\.)?word_embeddings_layernorm\.", "model.embed_norm."),
        (r"^(?:transformer\.)?ln_f\.", "model.norm."),
        (_LAYER + r"ln_attn\.", r"model.layers.\1.input_layernorm."),
        (_LAYER + r"ln_mlp\.", r"model.layers.\1.mlp_layernorm."),
        (_LAYER + r"(input_layernorm|post_attention_layernorm)\.", r"model.layers.\1.\2."),
        (_LAYER + r"self_attention\.query_key_value\.", r"model.layers.\1.self_attn.qkv_proj."),
        (_LAYER + r"self_attention\.dense\.", r"model.layers.\1.self_attn.o_proj."),
        (_LAYER + r"mlp\.dense_h_to_4h\.", r"model.layers.\1.mlp.up_proj."),
        (_LAYER + r"mlp\.dense_4h_to_h\.", r"model.layers.\1.mlp.down_proj."),
    )

    @classmethod
    def checkpoint_layout(cls, config: ModelConfig) -> CheckpointLayout:
        return CheckpointLayout(renames=cls.checkpoint_renames,
                                qkv_groups=(config.num_key_value_heads, config.head_dim))
