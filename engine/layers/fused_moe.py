"""Mixture-of-experts MLP: router top-k, then every expert over its own tokens, tensor-parallel over the
experts' intermediate dimension (each rank holds a slice of every expert; one all-reduce sums them).

Two ways to run the experts, same math:
- "triton" (CUDA): the (token, expert) pairs sorted by expert, two grouped GEMM launches for all experts
  (engine/kernels/moe.py), chosen once per device after a self-check against the torch path;
- "torch": the pairs sorted by expert and each expert that has tokens runs once over all of them
  (no per-token loop). The path on CPU, where each expert's matrices are reordered for oneDNN at load
  like every linear layer's (engine/layers/cpu_gemm.py, unless --cpu-gemm aten).
"""
from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import all_reduce, tp_rank, tp_size
from engine.layers import cpu_gemm
from engine.layers.activation import activation
from engine.layers.linear import divide
from engine.weights import read_shard

logger = logging.getLogger(__name__)

_BACKENDS: dict[tuple[str, torch.dtype], str] = {}  # (device type, dtype) -> chosen backend
MIN_PACKED_EXPERT_ELEMENTS = 2**16  # smaller expert matrices stay on F.linear (see FusedMoE.prepack_cpu_gemm)


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k]): softmax over all experts in float32, top-k, and with
    `renormalize` the k weights divided by their sum (Mixtral; Qwen-MoE's norm_topk_prob)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def experts_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor, act: nn.Module, packed: list[tuple[torch.Tensor, torch.Tensor]] | None = None
                  ) -> torch.Tensor:
    """Each expert once over the tokens routed to it; x [T, H], w13 [E, 2I, H], w2 [E, H, I] -> [T, H].

    The pairs are sorted by expert and gathered once, so each expert reads a contiguous slice, and the
    results go back to their tokens in one index_add. `packed`: per expert, oneDNN-reordered w13 and w2
    (engine/layers/cpu_gemm.py) used instead of the stacked weights.
    """
    order = torch.argsort(ids.reshape(-1), stable=True)
    num_experts = w13.shape[0] if packed is None else len(packed)
    counts = torch.bincount(ids.reshape(-1), minlength=num_experts).tolist()  # one sync: the group sizes
    tokens = order // ids.shape[1]
    inputs, scales = x[tokens], weights.reshape(-1)[order, None]
    outputs = torch.empty_like(inputs)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        end = start + count
        if packed is None:
            gate, up = F.linear(inputs[start:end], w13[expert]).chunk(2, dim=-1)
            outputs[start:end] = F.linear(act(gate) * up, w2[expert]) * scales[start:end]
        else:
            gate, up = cpu_gemm.linear(inputs[start:end], packed[expert][0], None).chunk(2, dim=-1)
            outputs[start:end] = cpu_gemm.linear(act(gate) * up, packed[expert][1], None) * scales[start:end]
        start = end
    return torch.zeros_like(x).index_add_(0, tokens, outputs)


def experts_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                   ids: torch.Tensor, act: nn.Module) -> torch.Tensor:
    """The grouped-GEMM path: one launch for all experts' gate/up, one for all their down projections."""
    from engine.kernels import moe

    num_tokens, top_k = ids.shape
    num_experts, num_pairs = w13.shape[0], num_tokens * top_k
    up_tiles = moe.tile_config(num_pairs, num_experts, w13.shape[1], w13.shape[2], x.dtype)
    down_tiles = moe.tile_config(num_pairs, num_experts, w2.shape[1], w2.shape[2], x.dtype)
    block_m = up_tiles.pop("block_m")
    down_tiles.pop("block_m")       # one sort serves both GEMMs: the same rows per expert
    sorted_pairs, block_experts = moe.align_by_expert(ids, num_experts, block_m)
    gate, up = moe.grouped_gemm(x, w13, sorted_pairs, block_experts, num_pairs, top_k, **up_tiles).chunk(2, dim=-1)
    hidden = act(gate) * up
    down = moe.grouped_gemm(hidden, w2, sorted_pairs, block_experts, num_pairs, 1, scales=weights, **down_tiles)
    return down.view(num_tokens, top_k, -1).sum(dim=1)


def choose_backend(device: torch.device, dtype: torch.dtype) -> str:
    """'triton' on CUDA when the kernel imports and agrees with the torch path, else 'torch' (cached)."""
    key = (device.type, dtype)
    if key not in _BACKENDS:
        _BACKENDS[key] = "torch" if device.type != "cuda" else _self_check(device, dtype)
    return _BACKENDS[key]


def _self_check(device: torch.device, dtype: torch.dtype) -> str:
    try:
        generator = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(37, 64, generator=generator, device=device, dtype=dtype)
        w13 = torch.randn(6, 96, 64, generator=generator, device=device, dtype=dtype) / 8
        w2 = torch.randn(6, 64, 48, generator=generator, device=device, dtype=dtype) / 8
        weights, ids = select_experts(torch.randn(37, 6, generator=generator, device=device), 2, True)
        act = nn.SiLU()
        want = experts_torch(x, w13, w2, weights, ids, act).float()
        got = experts_triton(x, w13, w2, weights, ids, act).float()
    except Exception as error:  # a broken Triton install must not take the engine down
        logger.warning("MoE Triton kernel failed its self-check (%s): experts run in torch", error)
        return "torch"
    error = (got - want).abs().max().item()
    tolerance = 1e-3 if dtype == torch.float32 else 5e-2
    if not error < tolerance * max(1.0, want.abs().max().item()):
        logger.warning("MoE Triton kernel disagrees with torch (max error %.3g): experts run in torch", error)
        return "torch"
    logger.info("MoE experts: Triton grouped GEMM")
    return "triton"


class FusedMoE(nn.Module):
    """The experts of one layer as stacked weights: w13 [E, 2 * I/tp, H] ([gate | up]), w2 [E, H, I/tp].

    `forward(x, router_logits)` returns the rank's partial sum, all-reduced over the ranks.
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, hidden_act: str = "silu") -> None:
        super().__init__()
        self.tp_rank = tp_rank()
        self.top_k, self.renormalize = top_k, renormalize
        self.intermediate = divide(intermediate_size, tp_size(), "moe_intermediate_size")
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.intermediate, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, self.intermediate), requires_grad=False)
        self.w13.weight_loader = self.weight_loader
        self.w2.weight_loader = self.weight_loader
        self.act = activation(hidden_act)
        self.backend: str | None = None
        self.packed: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def prepack_cpu_gemm(self) -> int:
        """Called by cpu_gemm.prepack_model: reorder every expert's matrices for oneDNN, free the stacks.

        Not for small experts: oneDNN's per-call cost made 64x32 experts 2x slower than F.linear, while
        512x256 ones ran 1.2-2x faster from 4 tokens per step on (docs/benchmarks.md, MoE).
        """
        if self.w2[0].numel() < MIN_PACKED_EXPERT_ELEMENTS:
            return 0
        self.packed = [(cpu_gemm.pack(self.w13[e]), cpu_gemm.pack(self.w2[e])) for e in range(self.w13.shape[0])]
        self.w13.data = self.w13.data.new_empty(0, *self.w13.shape[1:])
        self.w2.data = self.w2.data.new_empty(0, *self.w2.shape[1:])
        return 2 * len(self.packed)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: tuple[int | None, str]) -> None:
        """shard_id (expert, part): part "gate"/"up"/"down" of one expert's [out, in] matrix, or
        (None, "gate_up"/"down") for all experts stacked, as transformers 5 names them."""
        expert, part = shard_id
        size, start = self.intermediate, self.tp_rank * self.intermediate
        if expert is None:
            if part == "gate_up":  # [E, 2I, H]
                total = param.shape[1] // 2 * tp_size()
                param.data[:, :size].copy_(read_shard(loaded, 1, start, size))
                param.data[:, size:].copy_(read_shard(loaded, 1, total + start, size))
            else:  # down [E, H, I]
                param.data.copy_(read_shard(loaded, 2, start, size))
            return
        if part == "down":
            param.data[expert].copy_(read_shard(loaded, 1, start, size))
        else:
            offset = 0 if part == "gate" else size
            param.data[expert, offset:offset + size].copy_(read_shard(loaded, 0, start, size))

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize)
        if self.backend is None:
            self.backend = choose_backend(x.device, x.dtype)
        if self.backend == "triton":
            return all_reduce(experts_triton(x, self.w13, self.w2, weights, ids, self.act))
        return all_reduce(experts_torch(x, self.w13, self.w2, weights, ids, self.act, self.packed))
