"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the vocab."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import all_reduce, gather_to_rank0, tp_rank, tp_size
from engine.kernels import cpu_gemv
from engine.layers import cpu_gemm
from engine.weights import read_shard, shape_of


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // self.tp_size)  # padded so every rank holds the same rows
        self.vocab_start = self.tp_rank * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        rows = max(0, min(self.shard_size, shape_of(loaded)[0] - self.vocab_start))
        param.data.zero_()
        param.data[:rows].copy_(read_shard(loaded, 0, self.vocab_start, rows))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.shard_size)
        embeddings = F.embedding(local.clamp(0, self.shard_size - 1), self.weight)
        embeddings = embeddings * mine.unsqueeze(-1).to(embeddings.dtype)
        return all_reduce(embeddings)


class ParallelLMHead(VocabParallelEmbedding):
    """hidden -> logits; the vocab slices are gathered to rank 0 (None on the other ranks).

    `packed_weight` is set by `cpu_gemm.prepack_model` once the weights are loaded (CPU only). `few_rows_weight`, by
    engine/cpu_decode_step.py where the fused decode step is on: the weight packed for engine/kernels/cpu_gemv.py,
    which takes batches of up to FEW_ROWS rows (decode steps, a prefill's last tokens): SmolLM2's 49,152 x 576 head
    at 8 / 16 rows in 1.93 / 3.02 ms against oneDNN's 2.57 / 3.70 (slower from 24 rows; docs/benchmarks.md).
    """

    FEW_ROWS = 16
    packed_weight: torch.Tensor | None = None
    few_rows_weight: torch.Tensor | None = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        few = self.few_rows_weight
        if few is not None and hidden_states.dim() == 2 and hidden_states.shape[0] <= self.FEW_ROWS \
                and hidden_states.dtype == torch.float32 and hidden_states.stride(1) == 1:
            local = cpu_gemv.linear(hidden_states, few, self.shard_size)
        else:
            # a bfloat16 model's fused CPU decode step hands over float32 hidden states (engine/cpu_decode_step.py)
            local = cpu_gemm.matmul(hidden_states.to(self.weight.dtype), self.weight, self.packed_weight, None)
        logits = gather_to_rank0(local)
        return None if logits is None else logits[..., :self.vocab_size]
