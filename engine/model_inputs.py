"""Flatten the scheduler's spans into model inputs: token ids, positions, the attention layout."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import AttentionBackend, AttentionMetadata, build_metadata
from engine.batch import SeqSpan


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


def prepare_inputs(spans: list[SeqSpan], block_size: int, device: torch.device, backend: AttentionBackend,
                   windows: set[int | None]) -> ModelInputs:
    input_ids: list[int] = []
    positions: list[int] = []
    logits_rows: list[int] = []
    for span in spans:
        first_row = len(input_ids)
        input_ids += span.token_ids
        positions += range(span.start_pos, span.start_pos + len(span.token_ids))
        if span.logits == "all":
            logits_rows += range(first_row, len(input_ids))
        elif span.logits == "last":
            logits_rows.append(len(input_ids) - 1)
    meta = build_metadata(spans, block_size, device)
    backend.prepare(meta, windows)
    return ModelInputs(_tensor(input_ids, device), _tensor(positions, device), meta, _tensor(logits_rows, device))


def _tensor(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)
