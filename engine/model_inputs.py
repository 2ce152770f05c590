"""Flatten the scheduler's spans into model inputs: token ids, positions, cache slots, attention layout."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.batch import SeqSpan
from engine.layers.attention import AttentionMetadata


@dataclass(slots=True)
class ModelInputs:
    input_ids: torch.Tensor         # [T]
    positions: torch.Tensor         # [T]
    attention: AttentionMetadata
    logits_rows: torch.Tensor       # [R] token rows whose logits are computed


def validate_spans(spans: list[SeqSpan], block_size: int, num_blocks: int, max_position: int) -> None:
    """Catch scheduler bugs with a message instead of an index error deep inside a kernel."""
    for span in spans:
        end = span.start_pos + len(span.token_ids)
        if not span.token_ids:
            raise ValueError(f"sequence {span.seq_id}: empty span")
        if end > max_position:
            raise ValueError(f"sequence {span.seq_id}: position {end - 1} exceeds the model's "
                             f"max_position_embeddings={max_position}")
        if len(span.block_table) * block_size < end:
            raise ValueError(f"sequence {span.seq_id}: block table of {len(span.block_table)} blocks "
                             f"cannot hold {end} tokens (block_size={block_size})")
        if any(not 0 <= block < num_blocks for block in span.block_table):
            raise ValueError(f"sequence {span.seq_id}: block id out of range [0, {num_blocks})")


def prepare_inputs(spans: list[SeqSpan], block_size: int, device: torch.device, backend: str,
                   windows: set[int | None]) -> ModelInputs:
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logits_rows: list[int] = []
    for span in spans:
        first_row = len(input_ids)
        input_ids += span.token_ids
        for pos in range(span.start_pos, span.start_pos + len(span.token_ids)):
            positions.append(pos)
            slots.append(span.block_table[pos // block_size] * block_size + pos % block_size)
        if span.logits == "all":
            logits_rows += range(first_row, len(input_ids))
        elif span.logits == "last":
            logits_rows.append(len(input_ids) - 1)
    meta = AttentionMetadata(slot_mapping=_tensor(slots, device), num_seqs=len(spans),
                             max_query_len=max(len(s.token_ids) for s in spans),
                             max_context_len=max(s.start_pos + len(s.token_ids) for s in spans))
    if backend == "flash-attn-varlen":
        _flash_layout(meta, spans, device)
    else:
        _sdpa_layout(meta, spans, block_size, device, windows)
    return ModelInputs(_tensor(input_ids, device), _tensor(positions, device), meta,
                       _tensor(logits_rows, device))


def _sdpa_layout(meta: AttentionMetadata, spans: list[SeqSpan], block_size: int, device: torch.device,
                 windows: set[int | None]) -> None:
    max_q, max_ctx = meta.max_query_len, meta.max_context_len
    tables = _padded_tables(spans, device, torch.int64)
    context_pos = torch.arange(max_ctx, device=device)
    key_slots = tables[:, context_pos // block_size] * block_size + context_pos % block_size
    context_lens = _tensor([s.start_pos + len(s.token_ids) for s in spans], device)
    meta.key_slots = torch.where(context_pos[None, :] < context_lens[:, None], key_slots, 0)
    meta.query_rows = _tensor([b * max_q + i for b, s in enumerate(spans) for i in range(len(s.token_ids))], device)
    query_idx = torch.arange(max_q, device=device)
    query_pos = _tensor([s.start_pos for s in spans], device)[:, None] + query_idx  # [B, Q]
    is_query = query_idx[None, :] < _tensor([len(s.token_ids) for s in spans], device)[:, None]
    key_pos = context_pos[None, None, :]
    causal = (key_pos <= query_pos[..., None]) & is_query[..., None]  # [B, Q, K]
    for window in windows:
        mask = causal.clone() if window is None else causal & (key_pos > query_pos[..., None] - window)
        mask[..., 0] |= ~is_query  # padding rows attend to something: no NaN rows
        meta.masks[window] = mask[:, None]


def _flash_layout(meta: AttentionMetadata, spans: list[SeqSpan], device: torch.device) -> None:
    q_lens = [len(s.token_ids) for s in spans]
    k_lens = [s.start_pos + len(s.token_ids) for s in spans]
    meta.cu_seqlens_q = _cumulative(q_lens, device)
    meta.cu_seqlens_k = _cumulative(k_lens, device)
    meta.block_tables = _padded_tables(spans, device, torch.int32)


def _padded_tables(spans: list[SeqSpan], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    width = max(len(s.block_table) for s in spans)
    rows = [s.block_table + [0] * (width - len(s.block_table)) for s in spans]
    return torch.tensor(rows, dtype=dtype).to(device, non_blocking=True)


def _cumulative(lengths: list[int], device: torch.device) -> torch.Tensor:
    out = [0]
    for length in lengths:
        out.append(out[-1] + length)
    return torch.tensor(out, dtype=torch.int32).to(device, non_blocking=True)


def _tensor(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)
