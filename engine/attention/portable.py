"""Portable paged attention: plain torch, any device (the CPU default).

No query is padded to the longest one. Decode rows (one new token) of all sequences attend in one
batched SDPA over their gathered contexts (padded to the longest context, masked). Each prefill
chunk runs its own causal SDPA: a chunk with no cached context attends to its fresh K/V directly,
without touching the cache; a later chunk gathers its context from the cache.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.backend import AttentionBackend, attend, causal_mask
from engine.attention.metadata import AttentionMetadata


@dataclass(slots=True)
class _Prefill:
    rows: slice                                     # its rows in q
    key_slots: torch.Tensor | None                  # [K] cache slots of its whole context; None = fresh K/V only
    masks: dict[int | None, torch.Tensor | None]    # window -> [Q, K] (None = plain causal)


@dataclass(slots=True)
class _Decode:
    rows: torch.Tensor | None                       # [B] rows of the decode tokens; None = all rows, in order
    key_slots: torch.Tensor                         # [B * K] cache slot of each context position (0 past the end)
    width: int                                      # K, the longest context
    masks: dict[int | None, torch.Tensor]           # window -> [B, 1, 1, K]


class PortableBackend(AttentionBackend):
    name = "portable"
    # it gathers context rows slot by slot, so the block size only changes bookkeeping: 16, 32 and 64 measured
    # the same on CPU, 128 slower (docs/benchmarks.md); 16 wastes the least cache per sequence and shares
    # prompt prefixes at the finest grain
    default_block_size = 16

    def prepare(self, meta: AttentionMetadata, windows: set[int | None]) -> None:
        device = meta.slot_mapping.device
        decode_seqs = [b for b, length in enumerate(meta.query_lens_host) if length == 1]
        prefills = []
        starts = [0]
        for length in meta.query_lens_host:
            starts.append(starts[-1] + length)
        for b, length in enumerate(meta.query_lens_host):
            if length == 1:
                continue
            seq_len = meta.seq_lens_host[b]
            start_pos = seq_len - length
            rows = slice(starts[b], starts[b + 1])
            if start_pos == 0:
                masks = {w: None if w is None else causal_mask(length, 0, length, w, device) for w in windows}
                prefills.append(_Prefill(rows, None, masks))
            else:
                slots = _context_slots(meta, [b], seq_len)[0]
                masks = {w: causal_mask(length, start_pos, seq_len, w, device) for w in windows}
                prefills.append(_Prefill(rows, slots, masks))
        decode = None
        if decode_seqs:
            longest = max(meta.seq_lens_host[b] for b in decode_seqs)
            all_rows = len(decode_seqs) == meta.num_seqs
            rows = None if all_rows else torch.tensor([starts[b] for b in decode_seqs], device=device)
            key_slots = _context_slots(meta, decode_seqs, longest).flatten()
            lengths = torch.tensor([meta.seq_lens_host[b] for b in decode_seqs], device=device)[:, None]
            key_pos = torch.arange(longest, device=device)[None, :]
            masks = {}
            for window in windows:
                visible = key_pos < lengths
                if window is not None:
                    visible &= key_pos > lengths - 1 - window
                masks[window] = visible[:, None, None, :]
            decode = _Decode(rows, key_slots, longest, masks)
        meta.extra["portable"] = (decode, prefills)

    def forward(self, layer, q, k, v, meta):
        self.store(layer, k, v, meta.slot_mapping)
        if "portable" not in meta.extra:  # metadata built without this backend's prepare (tests, graphs)
            self.prepare(meta, {layer.sliding_window})
        decode, prefills = meta.extra["portable"]
        pure_decode = decode is not None and decode.rows is None  # the decode result is the whole output
        out = None if pure_decode else q.new_empty(q.shape)
        keys = layer.k_cache.view(-1, layer.num_kv_heads, layer.head_dim)
        values = layer.v_cache.view(-1, layer.num_kv_heads, layer.head_dim)
        window = layer.sliding_window
        if decode is not None:
            queries = q if decode.rows is None else q[decode.rows]
            # index_select copies whole rows: 4x faster on CPU than advanced indexing (keys[slots])
            shape = (queries.shape[0], decode.width, layer.num_kv_heads, layer.head_dim)
            context_k = keys.index_select(0, decode.key_slots).view(shape).transpose(1, 2)  # [B, kv, K, d]
            context_v = values.index_select(0, decode.key_slots).view(shape).transpose(1, 2)
            result = attend(layer, queries[:, :, None], context_k, context_v, decode.masks[window])[:, :, 0]
            if pure_decode:
                out = result
            else:
                out[decode.rows] = result
        for chunk in prefills:
            if chunk.key_slots is None:
                chunk_k, chunk_v = k[chunk.rows], v[chunk.rows]
            else:
                chunk_k, chunk_v = keys.index_select(0, chunk.key_slots), values.index_select(0, chunk.key_slots)
            result = attend(layer, q[chunk.rows].transpose(0, 1)[None], chunk_k.transpose(0, 1)[None],
                            chunk_v.transpose(0, 1)[None], chunk.masks[window])
            out[chunk.rows] = result[0].transpose(0, 1)
        return out.reshape(q.shape[0], -1)


def _context_slots(meta: AttentionMetadata, seqs: list[int], width: int) -> torch.Tensor:
    """[len(seqs), width] cache slot of positions 0..width-1 of each sequence (slot 0 past its end)."""
    device = meta.block_tables.device
    block_size = meta.block_size
    positions = torch.arange(width, device=device)
    index = torch.tensor(seqs, device=device)
    tables = meta.block_tables[index].long()
    slots = tables[:, positions // block_size] * block_size + positions % block_size
    lengths = torch.tensor([meta.seq_lens_host[b] for b in seqs], device=device)[:, None]
    return torch.where(positions[None, :] < lengths, slots, 0)
