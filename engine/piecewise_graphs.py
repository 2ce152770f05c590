"""Piecewise CUDA graphs: a step of any shape (prefill chunks, mixed prefill + decode, verified drafts) and of up to
512 tokens by default replays graphs of everything but attention, which runs eagerly between the pieces on the
step's own metadata.

Why: the decode graphs (engine/cuda_graphs.py) capture attention too, so they need a static batch layout and
take pure decode batches only; any step with a prefill chunk or drafts ran eagerly, ~15 launches per layer
from Python. Attention is the one op whose work depends on the batch's layout (sequence lengths, block
tables); everything else (embeddings, norms, projections, RoPE, the MLP or MoE, TP all-reduces) depends on
the token count alone. So a step of T tokens is padded to the next captured token count N, and the forward at
N is captured as L + 1 graphs cut at the L attention calls, as vLLM's piecewise graphs and SGLang's are.

How the cut is made: no compiler splits the model. While capturing, `Attention.forward` hands its q/k/v to
`split` (engine/layers/attention.py), which copies them into static buffers (still inside the graph), ends
the capture, and begins the next one, returning the static output buffer for the rest of the layer to read.
Tensors that cross a cut (the residual stream, RoPE's inputs) stay alive in the model's frame through the
capture, so the shared memory pool never hands their addresses to a later piece. At replay: piece i, then
attention of layer i on the first T rows of the static q/k/v with the step's metadata (built as for an eager
step), into the first T rows of the static output, then piece i + 1. Padding rows never reach attention: they
write no KV and read nothing; every other op is row-wise, so they cannot touch the real rows. LoRA layers read a
static token -> adapter map (padding rows on the base model) through launches that do not depend on it.

Off CUDA there is nothing to capture: `capture` records the layer order and `run` re-runs the forward on the
same static buffers with the same cut-time copies and row-limited attention, so the tests check padding,
buffers and the split on CPU (greedy equality for every family, TP=2 over gloo, a draft model, LoRA, EAGLE-3).
"""
from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

from engine.attention import AttentionMetadata
from engine.batch import SeqSpan, probe_decode_spans
from engine.graph_check import agrees, end_capture_pool
from engine.layers.attention import Attention
from engine.lora.batch import LoraBatch
from engine.model_inputs import ModelInputs, prepare_inputs

# Beyond this many tokens a step is compute-bound (an 8B model's forward of 512 tokens is ~8 TFLOP, several ms on
# an H100, against well under a millisecond of launches), so larger steps run eagerly unless a list asks for more,
# as vLLM's default capture sizes stop at 512.
MAX_DEFAULT_TOKENS = 512


def token_sizes(wanted: list[int] | None, enforce_eager: bool, max_tokens: int,
                max_batch_size: int | None) -> list[int]:
    """The token counts to capture: an explicit list as given (0 or empty = none), else 1, 2, 4, 8, every 16 to
    256, every 32 to 512, with max_batch_size (up to 512) so a full decode batch pads nothing, none above the
    largest step (`max_tokens`: the prefill budget plus a full batch of decodes)."""
    if enforce_eager:
        return []
    if wanted is not None:
        return sorted({size for size in wanted if size > 0})
    top = min(max_tokens, MAX_DEFAULT_TOKENS)
    sizes = [1, 2, 4, 8, *range(16, 256, 16), *range(256, MAX_DEFAULT_TOKENS + 1, 32)]
    if max_batch_size:
        sizes.append(min(max_batch_size, MAX_DEFAULT_TOKENS))
    limit = next(size for size in sorted(sizes) if size >= top)   # the smallest count that holds the largest step
    return sorted({size for size in sizes if size <= limit})


def forced_off_cuda() -> bool:
    """TGI_HPC_PIECEWISE_CPU=1: off CUDA, every engine runs the default ladder's split forward, as a GPU would
    (`TGI_HPC_PIECEWISE_CPU=1 pytest tests/engine`: the whole suite through the graphed step structure)."""
    return os.environ.get("TGI_HPC_PIECEWISE_CPU", "") not in ("", "0")


class PiecewiseGraphs:
    def __init__(self, model: torch.nn.Module, sizes: list[int], device: torch.device, dtype: torch.dtype,
                 lora: LoraBatch | None = None, taps: Any = None) -> None:
        if not sizes or min(sizes) < 1:
            raise ValueError(f"piecewise graph token counts must be >= 1, got {sizes}")
        self.model, self.sizes, self.device = model, sorted(set(sizes)), device
        largest = self.sizes[-1]
        self.lora = lora   # LoRA adapters: the pieces read their static token -> adapter map (engine/lora/batch.py)
        # EAGLE-3 (engine/spec_decode/eagle3.py): its hooks take layer inputs in the forward, which a replay skips;
        # what they took at capture is kept per size, rewritten by each replay, handed back trimmed to the real rows
        self.taps, self.tapped = taps, {}
        if lora is not None:
            lora.allocate_graph_map(largest, device)
        layers = model.attention_layers()
        q_width = max(layer.num_heads * layer.head_dim for layer in layers)
        kv_width = max(layer.num_kv_heads * layer.head_dim for layer in layers)
        with torch.inference_mode():   # one set of cut buffers for every layer and size: consumed in order
            self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
            self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
            self.q = torch.zeros(largest * q_width, dtype=dtype, device=device)
            self.k = torch.zeros(largest * kv_width, dtype=dtype, device=device)
            self.v = torch.zeros(largest * kv_width, dtype=dtype, device=device)
            self.out = torch.zeros(largest * q_width, dtype=dtype, device=device)
        self.pieces: dict[int, list] = {}        # size -> L + 1 graphs (CUDA)
        self.layers: dict[int, list[Attention]] = {}   # size -> the attention layers between them, in order
        self.outputs: dict[int, torch.Tensor] = {}

    @property
    def max_tokens(self) -> int:
        return self.sizes[-1]

    def _views(self, layer: Attention, n: int) -> tuple[torch.Tensor, ...]:
        h, kv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
        return (self.q[:n * h * d].view(n, h, d), self.k[:n * kv * d].view(n, kv, d),
                self.v[:n * kv * d].view(n, kv, d), self.out[:n * h * d].view(n, h * d))

    def _stash(self, layer: Attention, n: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        q_static, k_static, v_static, out = self._views(layer, n)
        q_static.copy_(q)
        k_static.copy_(k)
        v_static.copy_(v)
        return q_static, k_static, v_static, out

    def _forward(self, n: int, split: Callable) -> torch.Tensor:
        previous, Attention.split = Attention.split, split
        try:
            with self.lora.graphed(n) if self.lora is not None else nullcontext():
                return self.model(self.input_ids[:n], self.positions[:n], None)
        finally:
            Attention.split = previous

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every token count, largest first, all in one memory pool."""
        if self.device.type != "cuda":
            for n in reversed(self.sizes):
                order: list[Attention] = []

                def record(layer, q, k, v, n=n, order=order):
                    order.append(layer)
                    return self._stash(layer, n, q, k, v)[3]

                self.outputs[n] = self._forward(n, record)
                self.layers[n] = order
                if self.taps is not None:
                    self.tapped[n] = self.taps.graph_captured()
            return
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for n in reversed(self.sizes):
                self._capture_one(n, pool)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)

    def _capture_one(self, n: int, pool) -> None:
        def warm(layer, q, k, v):
            return self._stash(layer, n, q, k, v)[3]

        self._forward(n, warm)   # lazy initializations (cuBLAS workspaces, Triton's first launches) off the capture
        pieces, order = [torch.cuda.CUDAGraph()], []

        def cut(layer, q, k, v):
            out = self._stash(layer, n, q, k, v)[3]
            pieces[-1].capture_end()
            order.append(layer)
            pieces.append(torch.cuda.CUDAGraph())
            pieces[-1].capture_begin(pool=pool)
            return out

        pieces[0].capture_begin(pool=pool)
        try:
            output = self._forward(n, cut)
            pieces[-1].capture_end()
        except BaseException:
            try:
                pieces[-1].capture_end()
            except RuntimeError:    # the capture was invalidated: torch's allocator is still capturing into the pool
                end_capture_pool(self.device, pool)
            raise
        self.pieces[n], self.layers[n], self.outputs[n] = pieces, order, output
        if self.taps is not None:
            self.tapped[n] = self.taps.graph_captured()

    def can_run(self, spans: list[SeqSpan], num_tokens: int) -> bool:
        """A step of text spans within the largest captured count (images take the eager path)."""
        return 0 < num_tokens <= self.max_tokens and all(span.images is None for span in spans)

    @torch.inference_mode()
    def run(self, inputs: ModelInputs) -> torch.Tensor:
        """Final hidden states [T, hidden] of the step's tokens (replays the padded pieces)."""
        t = inputs.input_ids.shape[0]
        n = next(size for size in self.sizes if size >= t)
        self.input_ids[:t].copy_(inputs.input_ids)   # padding rows keep earlier ids and positions: valid, unread
        self.positions[:t].copy_(inputs.positions)
        if self.lora is not None:
            self.lora.stage(t, n)
        meta = inputs.attention
        if n not in self.pieces:   # off CUDA: the same buffers, cuts and row-limited attention, run eagerly
            order = iter(self.layers[n])

            def attend(layer, q, k, v):
                if layer is not next(order):
                    raise RuntimeError("piecewise forward reached the attention layers in another order")
                return self._attend(layer, n, t, meta, *self._stash(layer, n, q, k, v))

            self.outputs[n] = self._forward(n, attend)
            if self.taps is not None:   # what the hooks took now, into the tensors a replay would have written
                for index, tensor in self.taps.graph_captured().items():
                    self.tapped[n][index].copy_(tensor)
                self.taps.graph_ran(self.tapped[n], t)
            return self.outputs[n][:t]
        pieces = self.pieces[n]
        for piece, layer in zip(pieces, self.layers[n]):
            piece.replay()
            self._attend(layer, n, t, meta, *self._views(layer, n))
        pieces[-1].replay()
        if self.taps is not None:
            self.taps.graph_ran(self.tapped[n], t)
        return self.outputs[n][:t]

    @staticmethod
    def _attend(layer: Attention, n: int, t: int, meta: AttentionMetadata, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        out[:t].copy_(layer.cached(q[:t], k[:t], v[:t], meta))
        return out


@torch.inference_mode()
def matches_eager(graphs: PiecewiseGraphs, attention_layers: list, backend, block_size: int,
                  windows: set[int | None], num_blocks: int, tolerance: float) -> bool:
    """A mixed step (two decodes, a prefill chunk across a block boundary after a cached prefix, a fresh prompt:
    14 tokens whatever the block size) through the pieces, against the eager forward on the same cache. Runs at
    start-up, before any request owns a block: it scribbles on the first blocks of the cache."""
    device = graphs.device
    spans, next_block = probe_decode_spans([block_size + 3, 2 * block_size - 1], block_size, first_token=7)
    for seq_id, (first, start, length) in enumerate([(20, max(1, block_size - 2), 5), (40, 0, 7)], start=2):
        blocks = -(-(start + length) // block_size)
        spans.append(SeqSpan(seq_id, list(range(first, first + length)), start,
                             list(range(next_block, next_block + blocks))))
        next_block += blocks
    if next_block > num_blocks or sum(len(s.token_ids) for s in spans) > graphs.max_tokens:
        return True   # a cache (or a ladder) this small is no test bed; the pieces themselves still stand

    def probe() -> tuple[torch.Tensor, torch.Tensor]:
        inputs = prepare_inputs(spans, block_size, device, backend, windows)
        return graphs.model(inputs.input_ids, inputs.positions, inputs.attention), graphs.run(inputs)

    return agrees("piecewise CUDA graphs", "mixed steps run eagerly", attention_layers, next_block, device, probe,
                  tolerance)
