"""Which attention backend runs: a priority list per device, each candidate checked at start-up.

On CUDA: flash-attn (when importable; the fastest where it exists), then our Triton kernels (no
optional package: Triton ships with CUDA and ROCm torch), then portable torch. On CPU: our C++ kernel
reading the paged cache in place (cpu_paged, built with g++ at first use), then portable. Elsewhere: portable.
A candidate runs only if it can start here and its output on a mixed batch with the model's own
head layout (GQA, sliding windows, soft-capping) matches the float64 reference; every
tensor-parallel rank must agree. `--attention-backend NAME` forces one and fails loudly if it cannot run.
"""
from __future__ import annotations

import logging
import random
from collections.abc import Callable

import torch

from engine.attention.alibi import alibi_slopes
from engine.attention.backend import AttentionBackend
from engine.attention.cpu_paged import CpuPagedBackend
from engine.attention.flash import FlashBackend
from engine.attention.metadata import build_metadata
from engine.attention.portable import PortableBackend
from engine.attention.triton_backend import TritonBackend
from engine.batch import SeqSpan
from engine.kernels.attention_reference import paged_attention_reference

logger = logging.getLogger(__name__)

BACKENDS: dict[str, type[AttentionBackend]] = {"flash-attn": FlashBackend, "triton": TritonBackend,
                                               "cpu_paged": CpuPagedBackend, "portable": PortableBackend}
ALIASES = {"flash": "flash-attn", "sdpa": "portable", "torch": "portable"}
PRIORITY = {"cuda": ("flash-attn", "triton", "portable"), "cpu": ("cpu_paged", "portable")}
CHOICES = ("auto", *BACKENDS, *ALIASES)


def choose_backend(wanted: str, device: torch.device, dtype: torch.dtype, layers: list, block_size: int | None,
                   agree: Callable[[bool], bool] = lambda ok: ok) -> tuple[AttentionBackend, int, dict[str, str]]:
    """(backend, KV block size, {candidate: "ok" or why not}); `agree` ANDs a flag over the TP ranks."""
    name = ALIASES.get(wanted, wanted)
    if name != "auto" and name not in BACKENDS:
        raise ValueError(f"unknown attention backend {wanted!r}; choose one of {', '.join(CHOICES)}")
    order = PRIORITY.get(device.type, ("portable",)) if name == "auto" else (name,)
    report: dict[str, str] = {}
    for candidate in order:
        backend, size, reason, choices = _try(BACKENDS[candidate], device, dtype, layers, block_size)
        if not agree(reason is None):
            reason = reason or "another tensor-parallel rank cannot use it"
        report[candidate] = reason or "ok"
        if reason is None:
            report.update(choices)
            return backend, size, report
        if name != "auto":
            raise ValueError(f"attention backend {candidate!r} cannot run here: {reason}")
        logger.info("attention backend %s not used: %s", candidate, reason)
    raise RuntimeError(f"no attention backend passed its self-check: {report}")


def _try(cls: type[AttentionBackend], device, dtype, layers, block_size) -> tuple:
    size = block_size or cls.default_block_size
    reason = cls.unavailable_reason(device, dtype)
    if reason is None and not cls.supports_alibi and any(getattr(lay, "alibi_slopes", None) is not None
                                                         for lay in layers):
        reason = "it has no ALiBi (the model's attention bias)"
    if reason is None and (size & (size - 1) or (cls.block_sizes is not None and size not in cls.block_sizes)):
        reason = f"block size {size} is not one of {cls.block_sizes or 'the powers of two'}"
    if reason is not None:
        return None, size, reason, {}
    try:
        backend = cls()
        choices = backend.configure(layers, dtype)
        return backend, size, self_check(backend, device, dtype, layers, size), choices
    except Exception as error:  # a broken build must not take the engine down
        return None, size, f"failed its self-check with {type(error).__name__}: {error}", {}


# (new tokens, tokens already in the cache) per sequence: prefill from scratch, chunked prefill over
# two blocks, decodes at block edges; then the same decodes alone (kernels special-case one query)
CHECK_BATCHES = {"mixed": [(19, 0), (7, 5), (1, 1), (1, 2)], "decode": [(1, 0), (1, 15), (1, 40)]}


@torch.inference_mode()
def self_check(backend: AttentionBackend, device: torch.device, dtype: torch.dtype, layers: list,
               block_size: int) -> str | None:
    """None if the backend matches the reference on the model's own head layouts, else what differs."""
    from engine.layers.attention import Attention

    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    generator = torch.Generator(device=device).manual_seed(0)
    shapes = {(lay.num_heads, lay.num_kv_heads, lay.head_dim, lay.sliding_window, lay.logit_softcap,
               getattr(lay, "alibi_slopes", None) is not None) for lay in layers}
    for (heads, kv_heads, dim, window, softcap, alibi), (batch_name, lengths) in (
            (shape, batch) for shape in sorted(shapes, key=str) for batch in CHECK_BATCHES.items()):
        spans, num_blocks = _spans(lengths, block_size)
        slopes = alibi_slopes(heads).to(device) if alibi else None
        layer = Attention(heads, kv_heads, dim, dim ** -0.5, window, softcap, slopes)
        layer.impl = backend
        cache = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=generator, device=device).to(dtype)
        layer.k_cache, layer.v_cache = cache[0], cache[1]
        tokens = sum(q for q, _ in lengths)
        q, k, v = (torch.randn(tokens, n, dim, generator=generator, device=device).to(dtype)
                   for n in (heads, kv_heads, kv_heads))
        meta = build_metadata(spans, block_size, device)
        backend.prepare(meta, {window})
        out = layer(q, k, v, meta).view(tokens, heads, dim).float()
        expected = paged_attention_reference(q, layer.k_cache, layer.v_cache, cu_seqlens_q=meta.cu_seqlens_q,
                                             seq_lens=meta.seq_lens, block_tables=meta.block_tables,
                                             scale=layer.scale, window=window, softcap=softcap,
                                             alibi_slopes=slopes).float()
        error = (out - expected).abs().max().item()
        if not error <= tolerance:  # also catches NaN
            return (f"differs from the reference by {error:.3g} ({batch_name} batch, {heads}/{kv_heads} heads of "
                    f"{dim}, window {window}, softcap {softcap}{', ALiBi' if alibi else ''})")
    return None


def _spans(lengths: list[tuple[int, int]], block_size: int) -> tuple[list[SeqSpan], int]:
    """Spans over shuffled, non-contiguous blocks (block 0 left unused, as padding rows point there)."""
    needed = [-(-(q + cached) // block_size) for q, cached in lengths]
    blocks = list(range(1, 2 * sum(needed) + 1))
    random.Random(0).shuffle(blocks)
    spans = []
    for seq_id, ((q, cached), count) in enumerate(zip(lengths, needed)):
        spans.append(SeqSpan(seq_id, [0] * q, cached, blocks[:count]))
        blocks = blocks[count:]
    return spans, 2 * sum(needed) + 1
