"""Linear layers split across tensor-parallel ranks; each parameter knows how to load its shard."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.distributed import all_reduce, tp_rank, tp_size
from engine.layers import cpu_gemm
from engine.weights import read_full, read_shard, shape_of


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by the number of shards {denominator}; "
                         "pick a --num-shard that divides it")
    return numerator // denominator


class LinearBase(nn.Module):
    """y = x W^T + b with W of shape [output_size, input_size] (this rank's part).

    `packed_weight` is set by `cpu_gemm.prepack_model` once the weights are loaded (CPU only).
    """

    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        super().__init__()
        self.packed_weight: torch.Tensor | None = None
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_gemm.matmul(x, self.weight, self.packed_weight, self.bias)


def _copy(param_slice: torch.Tensor, tensor: torch.Tensor) -> None:
    if param_slice.shape != tensor.shape:
        raise ValueError(f"checkpoint shard of shape {tuple(tensor.shape)} does not fit "
                         f"{tuple(param_slice.shape)}")
    param_slice.copy_(tensor)


class ReplicatedLinear(LinearBase):
    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        _copy(param.data, read_full(loaded))


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; no communication."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, divide(output_size, tp_size(), "output features"), bias)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        size = param.shape[0]
        _copy(param.data, read_shard(loaded, 0, self.tp_rank * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices stacked in one (gate_proj + up_proj)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        _copy(param.data[offset:offset + size], read_shard(loaded, 0, self.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matrix; heads split across ranks.

    With fewer kv heads than ranks, each kv head is replicated on tp_size // num_kv_heads ranks.
    """

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool = False) -> None:
        size = tp_size()
        self.head_dim = head_dim
        self.num_heads = divide(total_num_heads, size, "num_attention_heads")
        if total_num_kv_heads >= size:
            self.num_kv_heads = divide(total_num_kv_heads, size, "num_key_value_heads")
            self.kv_head_start = tp_rank() * self.num_kv_heads
        else:
            divide(size, total_num_kv_heads, "shards per kv head: num_shard")
            self.num_kv_heads = 1
            self.kv_head_start = tp_rank() // (size // total_num_kv_heads)
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_dim * size
        super().__init__(hidden_size, output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, start = 0, q_size, self.tp_rank * q_size
        elif shard_id == "k":
            offset, size, start = q_size, kv_size, self.kv_head_start * self.head_dim
        elif shard_id == "v":
            offset, size, start = q_size + kv_size, kv_size, self.kv_head_start * self.head_dim
        else:
            raise ValueError(f"unknown qkv shard {shard_id!r}")
        _copy(param.data[offset:offset + size], read_shard(loaded, 0, start, size))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial results are summed with an all-reduce."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(divide(input_size, tp_size(), "input features"), output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        if len(shape_of(loaded)) == 1:  # bias: whole, added once after the reduce
            _copy(param.data, read_full(loaded))
            return
        size = param.shape[1]
        _copy(param.data, read_shard(loaded, 1, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = cpu_gemm.matmul(x, self.weight, self.packed_weight, self.bias if self.tp_rank == 0 else None)
        return all_reduce(y)
