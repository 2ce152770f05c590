"""Mixture-of-experts decoders: Mixtral, Qwen2-MoE (with a shared expert) and Qwen3-MoE.

The attention is the decoder's (Qwen3-MoE: q/k norm, Qwen2-MoE: qkv bias, from the config); the MLP
of an MoE layer is a replicated router plus FusedMoE (experts split over the intermediate dimension)
and, where the config has one, a shared expert behind a sigmoid gate. Qwen-MoE's `mlp_only_layers` /
`decoder_sparse_step` layers keep a dense MLP.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.layers.fused_moe import FusedMoE
from engine.layers.linear import ReplicatedLinear
from engine.model_config import ModelConfig
from engine.models.decoder import DecoderForCausalLM, DecoderMLP, dense_mlp


class SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts, bias=False)
        self.experts = FusedMoE(config.num_experts, config.num_experts_per_tok, config.hidden_size,
                                config.moe_intermediate_size, config.norm_topk_prob, config.hidden_act)
        self.has_shared_expert = config.shared_expert_intermediate_size > 0
        if self.has_shared_expert:
            self.shared_expert = DecoderMLP(config.hidden_size, config.shared_expert_intermediate_size,
                                            config.hidden_act, gated=True, bias=False)
            self.shared_expert_gate = ReplicatedLinear(config.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))
        if self.has_shared_expert:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def moe_or_dense_mlp(config: ModelConfig, layer_idx: int) -> nn.Module:
    return SparseMoeBlock(config) if config.is_moe_layer(layer_idx) else dense_mlp(config, layer_idx)


class MoeForCausalLM(DecoderForCausalLM):
    make_mlp = staticmethod(moe_or_dense_mlp)


class MixtralForCausalLM(MoeForCausalLM):
    checkpoint_renames = ((r"\.block_sparse_moe\.", ".mlp."),)


class Qwen2MoeForCausalLM(MoeForCausalLM):
    pass


class Qwen3MoeForCausalLM(MoeForCausalLM):
    pass
