"""Gemma 2 and Gemma 3 (text): the decoder with Gemma's knobs, all read from config.json by ModelConfig.

(1 + w) RMSNorm, a norm before and after each block, embeddings scaled by sqrt(hidden_size), GELU-tanh
gated MLP, attention scale query_pre_attn_scalar ** -0.5, sliding and global layers alternating;
Gemma 2 soft-caps attention and final logits, Gemma 3 norms q and k per head and gives its sliding
layers their own RoPE base. The checkpoint names are the engine's own, except in the multimodal Gemma 3
checkpoints (Gemma3ForConditionalGeneration), whose language model is served without its vision tower.
"""
from __future__ import annotations

from engine.models.decoder import DecoderForCausalLM


class Gemma2ForCausalLM(DecoderForCausalLM):
    pass


class Gemma3ForCausalLM(DecoderForCausalLM):
    pass


class Gemma3ForConditionalGeneration(DecoderForCausalLM):
    """The text part of a multimodal Gemma 3 (4B, 12B, 27B): images are not supported, their tower is skipped."""

    checkpoint_renames = ((r"^language_model\.model\.", "model."), (r"^model\.language_model\.", "model."),
                          (r"^language_model\.lm_head\.", "lm_head."))

    def skipped_checkpoint_tensors(self) -> tuple[str, ...]:
        return (*super().skipped_checkpoint_tensors(), "vision_tower.", "multi_modal_projector.")
