"""How a family's checkpoint tensors map onto the engine's parameters (the `route_checkpoint_tensor` hook
of engine/weights.py): renamed modules, fused q/k/v (one after the other, or grouped per KV head) and gate/up to
split, per-expert matrices into the stacked expert weights, GPT-2's Conv1D weights ([in, out]) transposed.

Views stay lazy: a rank still reads only the rows of its own shard from the safetensors file (a qkv tensor grouped
per KV head is read whole, then picked).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.weights import shape_of

# one expert's matrix (Mixtral w1/w3/w2, Qwen-MoE gate/up/down), or all experts stacked (transformers 5)
_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<part>w1|w2|w3|gate_proj|up_proj|down_proj)"
                     r"\.weight$")
_STACKED = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<part>gate_up_proj|down_proj)$")
_EXPERT_PARTS = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down",
                 "gate_up_proj": "gate_up"}


class Rows:
    """Rows [start, start + size) of a checkpoint tensor, read lazily."""

    def __init__(self, base: Any, start: int, size: int) -> None:
        self.base, self.start, self.size = base, start, size

    def get_shape(self) -> tuple[int, ...]:
        return (self.size, *shape_of(self.base)[1:])

    def __getitem__(self, index: Any):
        index = _as_tuple(index, len(self.get_shape()))
        first, last, _ = index[0].indices(self.size)
        return self.base[(slice(self.start + first, self.start + last), *index[1:])]


class Transposed:
    """A 2-D checkpoint tensor read as its transpose (1-D tensors pass through)."""

    def __init__(self, base: Any) -> None:
        self.base = base

    def get_shape(self) -> tuple[int, ...]:
        return tuple(reversed(shape_of(self.base)))

    def __getitem__(self, index: Any):
        index = _as_tuple(index, len(self.get_shape()))
        return self.base[tuple(reversed(index))].T if len(index) == 2 else self.base[index]


class GroupedHeads:
    """The q, k or v rows of a fused qkv tensor laid out per KV head: [kv_heads, q_per_kv + 2, head_dim, ...]
    (each group's query heads, then its key and its value head: Falcon, BLOOM). Read whole, then picked."""

    def __init__(self, base: Any, kv_heads: int, head_dim: int, part: str) -> None:
        self.base, self.kv_heads, self.head_dim, self.part = base, kv_heads, head_dim, part
        rows, *self.rest = shape_of(base)
        self.per_group = rows // (kv_heads * head_dim) - 2

    def get_shape(self) -> tuple[int, ...]:
        heads = self.per_group if self.part == "q" else 1
        return (self.kv_heads * heads * self.head_dim, *self.rest)

    def __getitem__(self, index: Any):
        grouped = torch.as_tensor(self.base[:]).view(self.kv_heads, self.per_group + 2, self.head_dim, *self.rest)
        pick = {"q": slice(0, self.per_group), "k": slice(self.per_group, self.per_group + 1),
                "v": slice(self.per_group + 1, self.per_group + 2)}[self.part]
        return grouped[:, pick].reshape(self.get_shape())[index]


def _as_tuple(index: Any, ndim: int) -> tuple[slice, ...]:
    index = index if isinstance(index, tuple) else (index,)
    return (*index, *[slice(None)] * (ndim - len(index)))


@dataclass
class CheckpointLayout:
    renames: tuple[tuple[str, str], ...] = ()      # (regex, replacement) applied in order to each name
    packed: dict[str, tuple[str, Any]] = field(default_factory=dict)  # separate q/k/v, gate/up -> fused
    transposed: str | None = None                  # regex of the (renamed) names stored as [in, out]
    qkv_sizes: tuple[int, int, int] | None = None  # fused qkv_proj in the checkpoint: rows of q, k, v
    gate_up_size: int | None = None                # fused gate_up_proj in the checkpoint: rows of each half
    qkv_groups: tuple[int, int] | None = None      # fused qkv_proj grouped per KV head: (kv heads, head_dim)

    def route(self, name: str, loaded: Any) -> list[tuple[str, Any, Any]]:
        for pattern, replacement in self.renames:
            name = re.sub(pattern, replacement, name)
        if self.transposed and re.search(self.transposed, name):
            loaded = Transposed(loaded)
        if match := _EXPERT.match(name):
            part = _EXPERT_PARTS[match["part"]]
            target = f"{match['prefix']}.{'w2' if part == 'down' else 'w13'}"
            return [(target, (int(match["expert"]), part), loaded)]
        if match := _STACKED.match(name):
            part = _EXPERT_PARTS[match["part"]]
            return [(f"{match['prefix']}.{'w2' if part == 'down' else 'w13'}", (None, part), loaded)]
        if self.qkv_groups and ".qkv_proj." in name:
            return [(name, part, GroupedHeads(loaded, *self.qkv_groups, part)) for part in ("q", "k", "v")]
        if self.qkv_sizes and ".qkv_proj." in name:
            return _split(name, loaded, ("q", "k", "v"), self.qkv_sizes)
        if self.gate_up_size and ".gate_up_proj." in name:
            return _split(name, loaded, (0, 1), (self.gate_up_size,) * 2)
        for fragment, (fused, shard_id) in self.packed.items():
            if f".{fragment}." in name:
                return [(name.replace(f".{fragment}.", f".{fused}."), shard_id, loaded)]
        return [(name, None, loaded)]


def _split(name: str, loaded: Any, shard_ids: tuple[Any, ...], sizes: tuple[int, ...]) -> list[tuple[str, Any, Any]]:
    parts, start = [], 0
    for shard_id, size in zip(shard_ids, sizes):
        parts.append((name, shard_id, Rows(loaded, start, size)))
        start += size
    return parts

