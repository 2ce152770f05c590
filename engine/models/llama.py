"""Llama-family decoder: Llama 2/3/3.1/3.2, Mistral (sliding window), Qwen2 (qkv bias), Qwen3 (q/k norm).

Tensor-parallel (Megatron layout): q/k/v and gate/up are column-parallel, o_proj and down_proj
row-parallel, embedding and LM head split over the vocabulary.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.distributed import tp_size
from engine.layers.activation import SiluAndMul
from engine.layers.attention import Attention, AttentionMetadata
from engine.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from engine.layers.layernorm import RMSNorm
from engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from engine.layers.rotary_embedding import RotaryEmbedding
from engine.model_config import ModelConfig


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, config.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=config.attention_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(config.num_attention_heads * config.head_dim, config.hidden_size,
                                        bias=config.o_proj_bias)
        self.rotary = rotary
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.attn = Attention(self.num_heads, self.num_kv_heads, config.head_dim, config.head_dim ** -0.5,
                              config.layer_sliding_window(layer_idx))

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                meta: AttentionMetadata | None) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v, meta))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size, size], bias=config.mlp_bias)
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=config.mlp_bias)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, rotary)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, meta)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta,
                                 config.rope_scaling)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, rotary) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata | None) -> torch.Tensor:
        hidden_states, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual, meta)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    # HF checkpoint names -> (fused parameter, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        check_tensor_parallel(config, tp_size())
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def skipped_checkpoint_tensors(self) -> tuple[str, ...]:
        skip = ("rotary_emb.inv_freq",)
        return (*skip, "lm_head.weight") if self.config.tie_word_embeddings else skip

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """Full-vocab logits on rank 0, None on the other ranks."""
        return self.lm_head(hidden_states)


def check_tensor_parallel(config: ModelConfig, num_shard: int) -> None:
    """Raise a clear ValueError when the model cannot be split over `num_shard` ranks."""
    problems = []
    if config.num_attention_heads % num_shard:
        problems.append(f"num_attention_heads={config.num_attention_heads}")
    kv = config.num_key_value_heads
    if (kv >= num_shard and kv % num_shard) or (kv < num_shard and num_shard % kv):
        problems.append(f"num_key_value_heads={kv} (must divide or be a multiple of it)")
    if config.intermediate_size % num_shard:
        problems.append(f"intermediate_size={config.intermediate_size}")
    for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):  # MoE models (engine/models/moe.py)
        if getattr(config, name, 0) % num_shard:
            problems.append(f"{name}={getattr(config, name)}")
    if problems:
        raise ValueError(f"{config.architecture} cannot be split over --num-shard {num_shard}: "
                         f"{', '.join(problems)} not divisible; use a num_shard that divides the head counts")
