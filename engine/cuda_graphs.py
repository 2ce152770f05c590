"""CUDA graphs of the decode forward, one per batch-size bucket (TGI's `--cuda-graphs`).

Why: a decode step of a small batch launches ~15 kernels per layer, and on a fast GPU the Python
and launch overhead of that is longer than the kernels themselves. Replaying a captured graph
launches them all at once, which is what lets batch-1 decode approach weight bytes / bandwidth.

A graph has fixed shapes and fixed addresses, so the forward runs on static buffers: a batch of
B decode tokens is padded to the smallest captured size >= B. Padding rows write their K/V into a
scratch block that the block manager never hands out, and attend to one token. The attention
backend must read every length from tensors (Triton's kernels, flash-attn's kvcache kernel): the
host-side bound `max_seq_len` is frozen at the longest context a graph can hold, and the split-KV
buffers come from the backend's `graph_workspace`, allocated once for the largest size.

Only pure decode batches go through graphs; prefill and mixed steps run eagerly. `matches_eager`
checks a padded replay against the eager forward at start-up; the worker drops the graphs if
it disagrees or raises.

On a device without CUDA, `capture` records a plain re-run of the forward on the same static
buffers instead of a graph: the tests use that to check padding, buffers and the decode kernel
path on CPU (with the Triton kernels interpreted, or stand-in backends).
"""
from __future__ import annotations

import numpy as np
import torch

from engine.attention import AttentionBackend, AttentionMetadata
from engine.attention.block_tables import BlockTables
from engine.batch import SeqSpan, probe_decode_spans
from engine.graph_check import agrees, end_capture_pool
from engine.model_inputs import prepare_inputs

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MAX_DEFAULT_SIZE = 512      # a larger --max-batch-size decodes its larger batches eagerly


def batch_sizes(wanted: list[int] | None, enforce_eager: bool, max_batch_size: int | None) -> list[int]:
    """The sizes to capture: TGI's `--cuda-graphs` list (0 or empty = none), never above max_batch_size;
    by default powers of two up to 256 and max_batch_size itself (up to 512), so a full batch replays too."""
    if enforce_eager:
        return []
    sizes = list(DEFAULT_BATCH_SIZES) if wanted is None else [size for size in wanted if size > 0]
    if wanted is None and max_batch_size:
        sizes.append(min(max_batch_size, MAX_DEFAULT_SIZE))
    if max_batch_size:
        sizes = [size for size in sizes if size <= max_batch_size] or [max_batch_size]
    return sorted(set(sizes))


class _EagerReplay:
    """Stands in for torch.cuda.CUDAGraph off CUDA: replay() re-runs the forward on the buffers."""

    def __init__(self, forward, output: torch.Tensor) -> None:
        self.forward, self.output = forward, output

    def replay(self) -> None:
        self.output.copy_(self.forward())


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, batch_sizes: list[int], max_blocks: int,
                 block_size: int, scratch_block: int, device: torch.device) -> None:
        if not batch_sizes or min(batch_sizes) < 1:
            raise ValueError(f"CUDA graph batch sizes must be >= 1, got {batch_sizes}")
        self.model, self.batch_sizes = model, sorted(set(batch_sizes))
        self.max_blocks, self.block_size, self.scratch_block = max_blocks, block_size, scratch_block
        self.device, self.backend = device, backend
        largest = self.batch_sizes[-1]
        with torch.inference_mode():  # the buffers are written under inference mode at every step
            # one host-to-device copy per step lands here, then fans out on the device (one sync, not five)
            self.staging = torch.zeros(largest * 4, dtype=torch.int64, device=device)
            # ... from pinned memory, asynchronously (a pageable copy would synchronize the stream every step);
            # `_staged` marks when the device has read it, before the next step rewrites it
            self.host_staging = torch.zeros(largest * 4, dtype=torch.int64, pin_memory=device.type == "cuda")
            self._staged: torch.cuda.Event | None = None
            self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
            self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
            self.slot_mapping = torch.full((largest,), scratch_block * block_size, dtype=torch.int64, device=device)
            self.seq_lens = torch.ones(largest, dtype=torch.int32, device=device)
            self.block_tables = torch.full((largest, max_blocks), scratch_block, dtype=torch.int32, device=device)
            self.cu_seqlens_q = torch.arange(largest + 1, dtype=torch.int32, device=device)
        first = model.attention_layers()[0]
        self.workspace = backend.graph_workspace(largest, first.num_heads, first.head_dim, max_blocks * block_size,
                                                 device)
        self.graphs: dict[int, object] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.tables = BlockTables(device, rows=largest, width=max_blocks, num_blocks=scratch_block)

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    def _metadata(self, size: int) -> AttentionMetadata:
        meta = AttentionMetadata(slot_mapping=self.slot_mapping[:size], cu_seqlens_q=self.cu_seqlens_q[:size + 1],
                                 seq_lens=self.seq_lens[:size], block_tables=self.block_tables[:size],
                                 block_size=self.block_size, num_seqs=size, max_query_len=1,
                                 max_seq_len=self.max_blocks * self.block_size)
        if self.workspace is not None:
            meta.extra["workspace"] = self.workspace
        return meta

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every batch size, largest first so the smaller graphs reuse its memory pool."""
        pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        for size in reversed(self.batch_sizes):
            meta = self._metadata(size)

            def forward(size=size, meta=meta):
                return self.model(self.input_ids[:size], self.positions[:size], meta)

            if self.device.type != "cuda":
                output = forward()
                self.graphs[size], self.outputs[size] = _EagerReplay(forward, output), output
                continue
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):  # warm-up off the capture: lazy inits, cuBLAS workspaces
                for _ in range(2):
                    forward()
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[size] = forward()
            except BaseException:   # an invalidated capture leaves torch's allocator capturing into the pool
                end_capture_pool(self.device, pool)
                raise
            self.graphs[size] = graph
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def can_run(self, spans: list[SeqSpan]) -> bool:
        """A batch of decode spans (one token, logits of it) that fits the largest graph."""
        return (0 < len(spans) <= self.max_batch_size
                and all(len(s.token_ids) == 1 and s.logits == "last" and len(s.block_table) <= self.max_blocks
                        for s in spans))

    @torch.inference_mode()
    def run(self, spans: list[SeqSpan], input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states [len(spans), hidden] of the spans' tokens (replays the padded graph); `input_ids`: the
        tokens of the first spans on the device, in place of theirs (engine/async_scheduling.py)."""
        count = len(spans)
        size = next(s for s in self.batch_sizes if s >= count)
        bs, scratch = self.block_size, self.scratch_block
        tables = self.tables.gather(spans)       # device-resident rows: only new blocks cross from the host
        positions = np.array([s.start_pos for s in spans], dtype=np.int64)
        if self._staged is not None:
            self._staged.synchronize()      # the previous step's copy is done with the pinned buffer
        values = self.host_staging.numpy()[:4 * size]   # input_ids, positions, slot_mapping, seq_lens; padded
        values[:count] = [s.token_ids[0] for s in spans]
        values[count:size] = 0
        values[size:size + count] = positions
        values[size + count:2 * size] = 0
        values[2 * size:2 * size + count] = self.tables.slots(positions, bs)     # from the kept table rows
        values[2 * size + count:3 * size] = scratch * bs
        values[3 * size:3 * size + count] = positions + 1
        values[3 * size + count:] = 1
        self.staging[:len(values)].copy_(self.host_staging[:len(values)], non_blocking=True)
        if self.device.type == "cuda":
            self._staged = torch.cuda.Event()
            self._staged.record(torch.cuda.current_stream(self.device))
        offset = 0
        for buffer in (self.input_ids, self.positions, self.slot_mapping, self.seq_lens):
            target = buffer[:size]
            target.copy_(self.staging[offset:offset + size])  # device-side, int64 -> the buffer's dtype
            offset += size
        if input_ids is not None:   # the first spans' tokens (a last prompt token after them is the host's)
            self.input_ids[:len(input_ids)].copy_(input_ids)
        width = tables.shape[1]
        self.block_tables[:count, :width].copy_(tables)
        self.block_tables[:count, width:].fill_(0)
        self.block_tables[count:size].fill_(scratch)
        self.graphs[size].replay()
        return self.outputs[size][:count]


@torch.inference_mode()
def matches_eager(graphs: DecodeGraphs, attention_layers: list, windows: set[int | None],
                  tolerance: float) -> bool:
    """Replay a padded decode batch and compare it with the eager forward on the same cache.

    Runs at start-up, before any request owns a block: it scribbles on the first blocks of the cache.
    """
    bs, device = graphs.block_size, graphs.device
    lengths = [min(n, graphs.max_blocks * bs) for n in (1, bs + 3, 2 * bs - 1)][:graphs.max_batch_size]
    spans, next_block = probe_decode_spans(lengths, bs, first_token=7)
    if next_block > graphs.scratch_block:
        return True  # a cache this small is no test bed; the graphs themselves still stand

    def probe() -> tuple[torch.Tensor, torch.Tensor]:
        inputs = prepare_inputs(spans, bs, device, graphs.backend, windows)
        return graphs.model(inputs.input_ids, inputs.positions, inputs.attention), graphs.run(spans)

    return agrees("decode CUDA graphs", "running eagerly", attention_layers, next_block, device, probe, tolerance)
