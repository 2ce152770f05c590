"""A decoder-only transformer parameterised by ModelConfig's family knobs; the family files
(engine/models/{moe,gemma,phi3,olmo2,starcoder2,gpt2,falcon,bloom}.py) add only their checkpoint layout and any
block of their own (the MoE MLP).

Knobs: norm kind (RMSNorm, Gemma's (1 + w) RMSNorm, LayerNorm) and placement (pre, Gemma's sandwich,
OLMo 2's post, Falcon's parallel attention and MLP), q/k norm per head or over all heads, gated or plain MLP and
its activation, biases, attention scale and logit soft-cap, sliding window per layer, RoPE (partial, per-layer
base), learned positions or ALiBi, scaled or normed embeddings, final logit soft-cap. Its defaults are Llama's
(engine/models/llama.py).

Tensor-parallel in Megatron's layout: q/k/v and gate/up are column-parallel, o_proj and down_proj
row-parallel, embedding and LM head split over the vocabulary.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.attention.alibi import alibi_slopes
from engine.distributed import layout, tp_rank, tp_size
from engine.layers.activation import activation, gated_activation
from engine.layers.attention import Attention, AttentionMetadata
from engine.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from engine.layers.layernorm import GemmaRMSNorm, LayerNorm, RMSNorm, ShardedRMSNorm
from engine.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                  RowParallelLinear)
from engine.layers.rotary_embedding import RotaryEmbedding
from engine.model_config import ModelConfig
from engine.models.checkpoint import CheckpointLayout

NORMS = {"rms": RMSNorm, "rms_gemma": GemmaRMSNorm, "layer": LayerNorm}


def make_norm(config: ModelConfig, size: int) -> RMSNorm:
    return NORMS[config.norm](size, config.rms_norm_eps)


class DecoderAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding | None) -> None:
        super().__init__()
        d = self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, d, config.num_attention_heads,
                                          config.num_key_value_heads, bias=config.attention_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(config.num_attention_heads * d, config.hidden_size, bias=config.o_proj_bias)
        self.rotary = rotary
        self.qk_norm = config.qk_norm_scope if config.qk_norm else None
        if self.qk_norm == "all":  # OLMo 2: over the whole projection, split across ranks
            self.q_norm = ShardedRMSNorm(self.num_heads * d, tp_rank() * self.num_heads * d, config.rms_norm_eps)
            self.k_norm = ShardedRMSNorm(self.num_kv_heads * d, self.qkv_proj.kv_head_start * d, config.rms_norm_eps)
        elif self.qk_norm == "head":
            self.q_norm, self.k_norm = make_norm(config, d), make_norm(config, d)
        slopes = None
        if config.position_embedding == "alibi":  # this rank's heads' slopes
            first = tp_rank() * self.num_heads
            slopes = alibi_slopes(config.num_attention_heads)[first:first + self.num_heads] * config.alibi_slope_scale
        self.attn = Attention(self.num_heads, self.num_kv_heads, d, config.attention_scale or d ** -0.5,
                              config.layer_sliding_window(layer_idx), logit_softcap=config.attn_logit_softcap,
                              alibi_slopes=slopes)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                meta: AttentionMetadata | None) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(hidden_states).split([q_size, kv_size, kv_size], dim=-1)
        if self.qk_norm == "all":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:
            q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v, meta))


class DecoderMLP(nn.Module):
    """down(act(gate) * up) when gated, else down(act(up)); column- then row-parallel."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, gated: bool, bias: bool) -> None:
        super().__init__()
        self.gated = gated
        if gated:
            self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias)
            self.act = gated_activation(hidden_act)
        else:
            self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias=bias)
            self.act = activation(hidden_act)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x) if self.gated else self.up_proj(x)))


def dense_mlp(config: ModelConfig, layer_idx: int) -> nn.Module:
    return DecoderMLP(config.hidden_size, config.intermediate_size, config.hidden_act, config.mlp_gated,
                      config.mlp_bias)


class DecoderLayer(nn.Module):
    """Carries (hidden_states, residual) between layers so the residual add fuses into the next norm."""

    def __init__(self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding | None, mlp: nn.Module) -> None:
        super().__init__()
        self.layout = config.norm_layout
        self.self_attn = DecoderAttention(config, layer_idx, rotary)
        self.mlp = mlp
        if self.layout != "post":
            self.input_layernorm = make_norm(config, config.hidden_size)
        if self.layout == "parallel_two_norms":
            self.mlp_layernorm = make_norm(config, config.hidden_size)
        elif self.layout != "parallel":
            self.post_attention_layernorm = make_norm(config, config.hidden_size)
        if self.layout == "sandwich":
            self.pre_feedforward_layernorm = make_norm(config, config.hidden_size)
        if self.layout in ("sandwich", "post"):
            self.post_feedforward_layernorm = make_norm(config, config.hidden_size)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata | None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.layout == "post":  # OLMo 2: x + norm(block(x)), no norm in front of the blocks
            x = hidden_states if residual is None else hidden_states + residual
            x = x + self.post_attention_layernorm(self.self_attn(positions, x, meta))
            return self.post_feedforward_layernorm(self.mlp(x)), x
        if self.layout.startswith("parallel"):  # Falcon: x + attn(norm(x)) + mlp(norm'(x)), side by side
            x = hidden_states if residual is None else hidden_states + residual
            mlp_in = attn_in = self.input_layernorm(x)
            if self.layout == "parallel_two_norms":
                mlp_in = self.mlp_layernorm(x)
            return self.self_attn(positions, attn_in, meta) + self.mlp(mlp_in), x
        if residual is None:
            residual, hidden_states = hidden_states, self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, meta)
        if self.layout == "sandwich":  # Gemma: each block's output is normed before the residual add
            hidden_states = self.post_attention_layernorm(hidden_states)
            hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
            return self.post_feedforward_layernorm(self.mlp(hidden_states)), residual
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class OtherStageLayer(nn.Module):
    """Stands in for a layer another pipeline stage holds: keeps checkpoint indices, holds nothing."""


class DecoderModel(nn.Module):
    """With pipeline parallelism (engine/pipeline.py) a stage builds only its layers: the embeddings on
    the first stage, the final norm (and the LM head) on the last; `layer_range` says which it holds."""

    def __init__(self, config: ModelConfig, make_mlp) -> None:
        super().__init__()
        stage = layout()
        self.layer_range = stage.layer_range(config.num_hidden_layers)
        self.embedding_multiplier = config.embedding_multiplier
        if stage.is_first_stage or (stage.is_last_stage and config.tie_word_embeddings):  # tied: the LM head's weight
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        if config.embedding_norm and stage.is_first_stage:  # BLOOM
            self.embed_norm = make_norm(config, config.hidden_size)
        if config.position_embedding == "learned" and stage.is_first_stage:  # GPT-2; replicated on every rank
            self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
            self.embed_positions.weight.requires_grad_(False)
        rotary = local_rotary = None
        if config.position_embedding == "rope":
            rotary_dim = int(config.head_dim * config.partial_rotary_factor)
            rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta,
                                     config.rope_scaling, rotary_dim)
            local_rotary = rotary if config.local_rope_theta is None else RotaryEmbedding(
                config.head_dim, config.max_position_embeddings, config.local_rope_theta, None, rotary_dim)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, local_rotary if config.layer_sliding_window(i) else rotary, make_mlp(config, i))
            if i in self.layer_range else OtherStageLayer() for i in range(config.num_hidden_layers))
        if stage.is_last_stage:
            self.norm = make_norm(config, config.hidden_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata | None) -> torch.Tensor:
        hidden_states, residual = self.run_layers(positions, self.embed(input_ids, positions), None, meta)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        if self.embedding_multiplier is not None:
            hidden_states = hidden_states * torch.tensor(self.embedding_multiplier, dtype=hidden_states.dtype)
        if hasattr(self, "embed_positions"):
            hidden_states = hidden_states + self.embed_positions(positions)
        if hasattr(self, "embed_norm"):
            hidden_states = self.embed_norm(hidden_states)
        return hidden_states

    def run_layers(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                   meta: AttentionMetadata | None) -> tuple[torch.Tensor, torch.Tensor]:
        """This stage's layers; (hidden_states, residual) go on to the next stage or the final norm."""
        for i in self.layer_range:
            hidden_states, residual = self.layers[i](positions, hidden_states, residual, meta)
        return hidden_states, residual


class DecoderForCausalLM(nn.Module):
    """The generic model; a family subclass sets its checkpoint layout and, for MoE, `make_mlp`."""

    # HF checkpoint names -> (fused parameter, shard id)
    packed_modules_mapping = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
                              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    checkpoint_renames: tuple[tuple[str, str], ...] = ()
    transposed_weights: str | None = None   # regex of checkpoint names stored as [in, out] (GPT-2 Conv1D)
    fused_checkpoint = False                # qkv_proj and gate_up_proj already fused in the checkpoint (Phi-3)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        check_tensor_parallel(config, tp_size())
        self.config = config
        self.model = DecoderModel(config, self.make_mlp)
        if layout().is_last_stage:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
            if config.tie_word_embeddings:
                self.lm_head.weight = self.model.embed_tokens.weight
        self.layout = self.checkpoint_layout(config)

    @staticmethod
    def make_mlp(config: ModelConfig, layer_idx: int) -> nn.Module:
        return dense_mlp(config, layer_idx)

    @classmethod
    def checkpoint_layout(cls, config: ModelConfig) -> CheckpointLayout:
        q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
        packed = {k: v for k, v in cls.packed_modules_mapping.items()
                  if config.mlp_gated or v[0] != "gate_up_proj"}  # a plain MLP's up_proj is its own
        return CheckpointLayout(renames=cls.checkpoint_renames, packed=packed,
                                transposed=cls.transposed_weights,
                                qkv_sizes=(q, kv, kv) if cls.fused_checkpoint else None,
                                gate_up_size=config.intermediate_size if cls.fused_checkpoint else None)

    def route_checkpoint_tensor(self, name: str, loaded: Any) -> list[tuple[str, Any, Any]]:
        return self.layout.route(name, loaded)

    def skipped_checkpoint_tensors(self) -> tuple[str, ...]:
        skip = ("rotary_emb.inv_freq",)
        return (*skip, "lm_head.weight") if self.config.tie_word_embeddings else skip

    def attention_layers(self) -> list[Attention]:
        """This stage's attention layers (all of them without pipeline parallelism), in order."""
        return [self.model.layers[i].self_attn.attn for i in self.model.layer_range]

    def other_stage_parameters(self) -> tuple[str, ...]:
        """Parameter-name prefixes other pipeline stages hold: their checkpoint tensors are skipped here."""
        held = dict(self.named_modules())
        names = [f"model.layers.{i}." for i in range(self.config.num_hidden_layers) if i not in self.model.layer_range]
        names += [f"{name}." for name in ("model.embed_tokens", "model.embed_positions", "model.embed_norm",
                                          "model.norm", "lm_head")
                  if name not in held]
        return tuple(names)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """Full-vocab logits on rank 0 (soft-capped where the model caps them), None on the other ranks."""
        logits = self.lm_head(hidden_states)
        cap = self.config.final_logit_softcap
        if logits is None or cap is None:
            return logits
        return torch.tanh(logits / cap) * cap


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
