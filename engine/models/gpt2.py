"""GPT-2: learned position embeddings, LayerNorm, GELU MLP, tied LM head. Its checkpoint names
(`transformer.h.N.attn.c_attn`, or without the `transformer.` prefix in the original upload) are mapped
onto the decoder's, and its Conv1D weights, stored [in, out], are read transposed."""
from __future__ import annotations

from engine.models.decoder import DecoderForCausalLM

_LAYER = r"^(?:transformer\.)?h\.(\d+)\."


class GPT2LMHeadModel(DecoderForCausalLM):
    checkpoint_renames = (
        (r"^(?:transformer\.)?wte\.", "model.embed_tokens."),
        (r"^(?:transformer\.)?wpe\.", "model.embed_positions."),
        (r"^(?:transformer\.)?ln_f\.", "model.norm."),
        (_LAYER + r"ln_1\.", r"model.layers.\1.input_layernorm."),
        (_LAYER + r"ln_2\.", r"model.layers.\1.post_attention_layernorm."),
        (_LAYER + r"attn\.c_attn\.", r"model.layers.\1.self_attn.qkv_proj."),
        (_LAYER + r"attn\.c_proj\.", r"model.layers.\1.self_attn.o_proj."),
        (_LAYER + r"mlp\.c_fc\.", r"model.layers.\1.mlp.up_proj."),
        (_LAYER + r"mlp\.c_proj\.", r"model.layers.\1.mlp.down_proj."),
    )
    transposed_weights = r"\.(qkv_proj|o_proj|up_proj|down_proj)\.weight$"
    fused_checkpoint = True  # c_attn holds q, k and v

    def skipped_checkpoint_tensors(self) -> tuple[str, ...]:
        # attn.bias / attn.masked_bias: causal-mask buffers in older uploads, not weights
        return (*super().skipped_checkpoint_tensors(), ".attn.bias", ".attn.masked_bias")
