"""Portable paged attention: plain torch, any device (the CPU default).

Decode rows (one new token) of all sequences attend in one batched SDPA over their gathered contexts
(padded to the longest context, masked). Short spans over a cached context (speculative verification:
a decode token and its drafts) join that batch, their queries padded to the longest such span. Each
prefill chunk runs its own causal SDPA: a chunk with no cached context attends to its fresh K/V
directly, without touching the cache; a later chunk gathers its context from the cache. A chunk with image
tokens that attend both ways (Gemma 3) is always a prefill chunk, its mask widened (bidirectional.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.backend import AttentionBackend, attend, causal_mask
from engine.attention.bidirectional import widen
from engine.attention.metadata import AttentionMetadata


@dataclass(slots=True)
class _Prefill:
    rows: slice                                     # its rows in q
    key_slots: torch.Tensor | None                  # [K] cache slots of its whole context; None = fresh K/V only
    masks: dict[int | None, torch.Tensor | None]    # window -> [Q, K] (None = plain causal)


# longest span batched with the decode rows; longer ones are prefill chunks
MAX_BATCHED_QUERY = 8


@dataclass(slots=True)
class _Decode:
    rows: torch.Tensor | None                       # [B * Q] rows of q, each span padded to Q by repeating its
                                                    # last row; None = all rows, in order, Q = 1
    num_queries: int                                # Q, the longest batched span (1 without drafts)
    kept: torch.Tensor | None                       # [N] which of the B * Q results are real; None = all
    out_rows: torch.Tensor | None                   # [N] their rows in the output; None = rows
    key_slots: torch.Tensor                         # [B * K] cache slot of each context position (0 past the end)
    width: int                                      # K, the longest context
    masks: dict[int | None, torch.Tensor]           # window -> [B, 1, Q, K]


class PortableBackend(AttentionBackend):
    name = "portable"
    supports_alibi = True
    supports_bidirectional_images = True
    # it gathers context rows slot by slot, so the block size only changes bookkeeping: 16, 32 and 64 measured
    # the same on CPU, 128 slower (docs/benchmarks.md); 16 wastes the least cache per sequence and shares
    # prompt prefixes at the finest grain
    default_block_size = 16

    def prepare(self, meta: AttentionMetadata, windows: set[int | None]) -> None:
        lengths = meta.query_lens_host
        batched = batched_seqs(meta)
        starts = row_starts(lengths)
        prefills = prefill_chunks(meta, set(batched), starts, windows)
        decode = _batched(meta, batched, starts, windows) if batched else None
        meta.extra["portable"] = (decode, prefills)

    def forward(self, layer, q, k, v, meta):
        self.store(layer, k, v, meta.slot_mapping)
        if "portable" not in meta.extra:  # metadata built without this backend's prepare (tests, graphs)
            self.prepare(meta, {layer.sliding_window})
        decode, prefills = meta.extra["portable"]
        pure_decode = decode is not None and decode.rows is None  # the decode result is the whole output
        out = None if pure_decode else q.new_empty(q.shape)
        if decode is not None:
            keys = layer.k_cache.view(-1, layer.num_kv_heads, layer.head_dim)
            values = layer.v_cache.view(-1, layer.num_kv_heads, layer.head_dim)
            num_seqs, width = decode.key_slots.shape[0] // decode.width, decode.width
            queries = q if decode.rows is None else q.index_select(0, decode.rows)
            queries = queries.view(num_seqs, decode.num_queries, *q.shape[1:]).transpose(1, 2)  # [B, H, Q, d]
            # index_select copies whole rows: 4x faster on CPU than advanced indexing (keys[slots])
            shape = (num_seqs, width, layer.num_kv_heads, layer.head_dim)
            context_k = keys.index_select(0, decode.key_slots).view(shape).transpose(1, 2)  # [B, kv, K, d]
            context_v = values.index_select(0, decode.key_slots).view(shape).transpose(1, 2)
            result = attend(layer, queries, context_k, context_v, decode.masks[layer.sliding_window])
            result = result.transpose(1, 2).reshape(-1, *q.shape[1:])                       # [B * Q, H, d]
            if pure_decode:
                out = result
            elif decode.kept is None:
                out[decode.rows] = result
            else:
                out[decode.out_rows] = result[decode.kept]
        run_prefills(layer, q, k, v, prefills, out)
        return out.reshape(q.shape[0], -1)


def batched_seqs(meta: AttentionMetadata) -> list[int]:
    """The sequences attending as decode rows or short spans over a cached context (the rest are prefill chunks)."""
    lengths, seq_lens, images = meta.query_lens_host, meta.seq_lens_host, meta.bidirectional
    return [b for b, length in enumerate(lengths)
            if length == 1 or (length <= MAX_BATCHED_QUERY and seq_lens[b] > length and b not in images)]


def row_starts(lengths: list[int]) -> list[int]:
    starts = [0]
    for length in lengths:
        starts.append(starts[-1] + length)
    return starts


def prefill_chunks(meta: AttentionMetadata, batched: set[int], starts: list[int],
                   windows: set[int | None]) -> list[_Prefill]:
    """Every sequence not in `batched` as a prefill chunk with its masks (and its context's slots if cached)."""
    device = meta.slot_mapping.device
    prefills = []
    for b, length in enumerate(meta.query_lens_host):
        if b in batched:
            continue
        seq_len = meta.seq_lens_host[b]
        start_pos = seq_len - length
        rows = slice(starts[b], starts[b + 1])
        runs = meta.bidirectional.get(b)
        if runs:  # image tokens that also see their image's later tokens
            masks = {w: widen(causal_mask(length, start_pos, seq_len, w, device), runs, start_pos) for w in windows}
            prefills.append(_Prefill(rows, None if start_pos == 0 else _context_slots(meta, [b], seq_len)[0], masks))
        elif start_pos == 0:
            masks = {w: None if w is None else causal_mask(length, 0, length, w, device) for w in windows}
            prefills.append(_Prefill(rows, None, masks))
        else:
            slots = _context_slots(meta, [b], seq_len)[0]
            masks = {w: causal_mask(length, start_pos, seq_len, w, device) for w in windows}
            prefills.append(_Prefill(rows, slots, masks))
    return prefills


def run_prefills(layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefills: list[_Prefill],
                 out: torch.Tensor) -> None:
    """Each prefill chunk's causal SDPA into its rows of out [T, H, d]."""
    keys = layer.k_cache.view(-1, layer.num_kv_heads, layer.head_dim)
    values = layer.v_cache.view(-1, layer.num_kv_heads, layer.head_dim)
    window = layer.sliding_window
    for chunk in prefills:
        if chunk.key_slots is None:
            chunk_k, chunk_v = k[chunk.rows], v[chunk.rows]
        else:
            chunk_k, chunk_v = keys.index_select(0, chunk.key_slots), values.index_select(0, chunk.key_slots)
        result = attend(layer, q[chunk.rows].transpose(0, 1)[None], chunk_k.transpose(0, 1)[None],
                        chunk_v.transpose(0, 1)[None], chunk.masks[window])
        out[chunk.rows] = result[0].transpose(0, 1)


def _batched(meta: AttentionMetadata, seqs: list[int], starts: list[int], windows: set[int | None]) -> _Decode:
    """The decode rows and short spans `seqs` as one [B, Q] query batch over their gathered contexts."""
    device = meta.slot_mapping.device
    lengths = [meta.query_lens_host[b] for b in seqs]
    num_queries = max(lengths)
    longest = max(meta.seq_lens_host[b] for b in seqs)
    key_slots = _context_slots(meta, seqs, longest).flatten()
    key_pos = torch.arange(longest, device=device)[None, None, :]
    offsets = [min(i, length - 1) for length in lengths for i in range(num_queries)]  # pads repeat the last row
    query_pos = torch.tensor([meta.seq_lens_host[b] - lengths[j] + offsets[j * num_queries + i]
                              for j, b in enumerate(seqs) for i in range(num_queries)], device=device)
    query_pos = query_pos.view(len(seqs), num_queries, 1)
    masks = {}
    for window in windows:
        visible = key_pos <= query_pos
        if window is not None:
            visible &= key_pos > query_pos - window
        masks[window] = visible[:, None]
    if num_queries == 1:
        rows = None if len(seqs) == meta.num_seqs else torch.tensor([starts[b] for b in seqs], device=device)
        return _Decode(rows, 1, None, None, key_slots, longest, masks)
    rows = [starts[b] + offsets[j * num_queries + i] for j, b in enumerate(seqs) for i in range(num_queries)]
    kept = [j * num_queries + i for j, length in enumerate(lengths) for i in range(length)]
    return _Decode(torch.tensor(rows, device=device), num_queries, torch.tensor(kept, device=device),
                   torch.tensor([rows[k] for k in kept], device=device), key_slots, longest, masks)


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
