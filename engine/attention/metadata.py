"""The attention layout of one step, shared by every backend and built once per step.

A step is a flattened varlen batch: sequence b contributes q_len[b] new tokens (rows
cu_seqlens_q[b]:cu_seqlens_q[b+1] of q), which are the last q_len[b] of its seq_lens[b] positions.
Their K/V go to `slot_mapping` (block * block_size + offset); every position's K/V is read through
the sequence's row of `block_tables`. Host copies of the lengths ride along so that backends that
loop on the host (portable) or size launch grids need no device->host copy.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from engine.attention.block_tables import BlockTables
from engine.batch import SeqSpan
from engine.device_copy import to_device


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor              # [T] int64 cache slot of each new token
    cu_seqlens_q: torch.Tensor              # [B + 1] int32
    seq_lens: torch.Tensor                  # [B] int32 positions per sequence, new tokens included
    block_tables: torch.Tensor              # [B, max_blocks] int32, rows padded with block 0
    block_size: int
    num_seqs: int
    max_query_len: int
    max_seq_len: int                        # host bound on seq_lens (a fixed one inside CUDA graphs)
    query_lens_host: list[int] = field(default_factory=list)
    seq_lens_host: list[int] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # a backend's per-step precomputation
    # sequence index -> the [start, end) image runs its span touches whose tokens attend both ways (Gemma 3)
    bidirectional: dict[int, list[tuple[int, int]]] = field(default_factory=dict)


def build_metadata(spans: list[SeqSpan], block_size: int, device: torch.device,
                   tables: BlockTables | None = None) -> AttentionMetadata:
    """The step's layout; with `tables`, block tables come from the device-resident copy (updated by what
    changed since the last step) instead of being rebuilt from the spans' lists."""
    query_lens = [len(span.token_ids) for span in spans]
    block_tables = tables.gather(spans) if tables is not None else None
    if len(query_lens) == sum(query_lens):      # decodes only (one token each): list comprehensions, no loops
        seq_lens = [span.start_pos + 1 for span in spans]
        if tables is not None:  # each token's block from the kept table rows: no walk through the spans' lists
            slot_mapping = torch.from_numpy(tables.slots(np.array(seq_lens, dtype=np.int64) - 1, block_size))
        else:
            slot_mapping = _host([span.block_table[span.start_pos // block_size] * block_size
                                  + span.start_pos % block_size for span in spans], np.int64)
        cu_seqlens = list(range(len(spans) + 1))
        bidirectional: dict[int, list[tuple[int, int]]] = {}  # a one-token span sees no later key, not in an image
    else:
        seq_lens = [span.start_pos + length for span, length in zip(spans, query_lens)]
        slots = []
        for span, length in zip(spans, query_lens):
            table = span.block_table
            slots += [table[pos // block_size] * block_size + pos % block_size
                      for pos in range(span.start_pos, span.start_pos + length)]
        slot_mapping = _host(slots, np.int64)
        cu_seqlens = [0]
        for length in query_lens:
            cu_seqlens.append(cu_seqlens[-1] + length)
        bidirectional = {b: runs for b, span in enumerate(spans) if span.images is not None
                         and (runs := span.images.runs_in(span.start_pos, span.start_pos + len(span.token_ids)))}
    if block_tables is None:
        width = max(len(span.block_table) for span in spans)
        padded = [span.block_table + [0] * (width - len(span.block_table)) for span in spans]
        block_tables = to_device(torch.tensor(padded, dtype=torch.int32), device)
    return AttentionMetadata(
        slot_mapping=to_device(slot_mapping, device),
        cu_seqlens_q=to_device(_host(cu_seqlens, np.int32), device),
        seq_lens=to_device(_host(seq_lens, np.int32), device),
        block_tables=block_tables,
        block_size=block_size, num_seqs=len(spans), max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_lens_host=query_lens, seq_lens_host=seq_lens,
        bidirectional=bidirectional)


def _host(values: list[int], dtype: type) -> torch.Tensor:
    """A CPU tensor of `values` through numpy: 3x cheaper than torch.tensor(list) (6 vs 16 us for 256)."""
    return torch.from_numpy(np.array(values, dtype=dtype))

