"""Linear layers split across tensor-parallel ranks; each parameter knows how to load its shard."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.distributed import all_reduce, tp_rank, tp_size
from engine.layers import quantization
from engine.layers.quantization.base import Layout, simple_loader


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by the number of shards {denominator}; "
                         "pick a --num-shard that divides it")
    return numerator // denominator


class LinearBase(nn.Module):
    """y = x W^T + b with W of shape [output_size, input_size] (this rank's part).

    How W is stored, loaded and multiplied is the layer's quantization method (engine.layers.quantization),
    chosen once when the model is built; subclasses only say which part of each checkpoint tensor this
    rank holds (`output_piece`, `input_piece`). `lora` (engine.lora.stack.LayerLora, set when adapters are
    loaded) adds each token's low-rank adapter update to the output.
    """

    lora = None

    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.input_size, self.output_size = input_size, output_size
        self.method = quantization.current_method()
        self.method.create_weights(self, input_size, output_size)
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = simple_loader(self, "bias", Layout(out_axis=0), 0)
        else:
            self.register_parameter("bias", None)

    def output_piece(self, shard_id: Any) -> tuple[int, int, int]:
        """(offset in this rank's output, start in the checkpoint tensor, size), in output features."""
        return 0, 0, self.output_size

    def input_piece(self) -> tuple[int, int] | None:
        """(start, size) of this rank's input features in the checkpoint; None when not split."""
        return None

    def finish_loading(self) -> None:
        self.method.finish_loading(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, x, self.bias)
        return y if self.lora is None else self.lora.add(x, y)


class ReplicatedLinear(LinearBase):
    pass


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; no communication."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, divide(output_size, tp_size(), "output features"), bias)

    def output_piece(self, shard_id: Any) -> tuple[int, int, int]:
        return 0, self.tp_rank * self.output_size, self.output_size


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices stacked in one (gate_proj + up_proj)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def output_piece(self, shard_id: Any) -> tuple[int, int, int]:
        size = self.output_sizes[shard_id] // self.tp_size
        return sum(self.output_sizes[:shard_id]) // self.tp_size, self.tp_rank * size, size


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

    def output_piece(self, shard_id: Any) -> tuple[int, int, int]:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        if shard_id == "q":
            return 0, self.tp_rank * q_size, q_size
        if shard_id == "k":
            return q_size, self.kv_head_start * self.head_dim, kv_size
        if shard_id == "v":
            return q_size + kv_size, self.kv_head_start * self.head_dim, kv_size
        raise ValueError(f"unknown qkv shard {shard_id!r}")


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial results are summed with an all-reduce."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(divide(input_size, tp_size(), "input features"), output_size, bias)

    def input_piece(self) -> tuple[int, int] | None:
        return self.tp_rank * self.input_size, self.input_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the bias is whole on every rank and added once, after the reduce
        y = self.method.apply(self, x, self.bias if self.tp_rank == 0 else None)
        if self.lora is not None:  # x A_rank^T is this rank's part of x A^T: its update is reduced with y
            y = self.lora.add(x, y)
        return all_reduce(y)
