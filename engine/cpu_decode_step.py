"""Decode steps on CPU run as one C++ call over all the layers (engine/kernels/cpu_decoder_layers.py): the CPU's
counterpart of the decode CUDA graphs (engine/cuda_graphs.py), for the same reason: the host work between
kernels.

It serves a step when every span decodes one token and there are at most MAX_ROWS of them (32), for a native
Llama-layout model (pre-norm RMSNorm, gated SiLU MLP, RoPE, no q/k norm, no sliding window or soft-cap,
optional q/k/v/o/MLP biases) in float32 or bfloat16 (float32 activations either way) on one CPU rank, with the fused
element-wise kernels and the cpu_paged
attention, and without LoRA, speculation, quantized layers or images. Other steps (prefill chunks, larger
batches) run the eager model as before. The linears read their own copy of the weights, packed for few rows
(engine/kernels/cpu_gemv.py), and so does the LM head for batches of up to 16 rows (ParallelLMHead.FEW_ROWS, any
step); the copy is made only when it fits COPY_SHARE of the process's memory limit
(engine/host_memory.py). A bfloat16 checkpoint served in float32 keeps that copy in bfloat16: its values are
bfloat16s, so the products are the same and a step streams half the weight bytes. `--enforce-eager` turns the step
off.

At start-up, before any request owns a block, `build` runs a decode batch through both paths on the first
blocks of the cache and keeps the fused step only when it matches the eager forward. What it chose and why
shows in /info (`decode_step`).
"""
from __future__ import annotations

import ctypes
import logging

import torch

from engine import huge_pages
from engine.attention.cpu_paged import CpuPagedBackend
from engine.batch import SeqSpan, probe_decode_spans
from engine.host_memory import memory_limit
from engine.kernels import cpu_attention, cpu_decoder_layers, cpu_elementwise, cpu_gemv
from engine.kernels.cpp_build import address
from engine.layers.activation import SiluAndMul
from engine.layers.embed_head import ParallelLMHead
from engine.layers.layernorm import RMSNorm
from engine.model_inputs import ModelInputs, prepare_inputs

logger = logging.getLogger(__name__)

MAX_ROWS = 32       # decode batches up to this run fused (the GEMV in passes of 16 rows); larger ones run the eager model
COPY_SHARE = 0.25   # the packed weights' copy may take at most this share of the memory limit


def unsupported_reason(worker) -> str | None:
    """Why this worker's model cannot take the fused step (None when it can)."""
    config, model = worker.config, worker.model
    if worker.device.type != "cpu":
        return "not a CPU engine"
    if config.enforce_eager:
        return "--enforce-eager"
    if worker.dtype not in (torch.float32, torch.bfloat16):
        return f"dtype {worker.dtype} (the fused step serves float32 and bfloat16 models)"
    if config.num_shard > 1 or worker.layout.pp_size > 1:
        return "tensor or pipeline parallelism"
    if worker.lora is not None or worker.draft is not None or worker.heads is not None or config.speculative_layers:
        return "LoRA adapters or speculation"
    if worker.encoder_cache is not None:
        return "a multimodal model"
    cfg = worker.model_config
    if type(model).__name__ == "TransformersForCausalLM" or not hasattr(model, "model") \
            or not hasattr(model.model, "layers"):
        return "not a native decoder"
    if (cfg.norm, cfg.norm_layout, cfg.position_embedding) != ("rms", "pre", "rope") or cfg.qk_norm \
            or not cfg.mlp_gated or cfg.hidden_act != "silu":
        return "not the Llama layout (pre-norm RMSNorm, RoPE, gated SiLU MLP, no q/k norm)"
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if type(layer.input_layernorm) is not RMSNorm or type(layer.post_attention_layernorm) is not RMSNorm \
                or not isinstance(getattr(mlp, "act", None), SiluAndMul) or not hasattr(mlp, "gate_up_proj"):
            return "a layer outside the Llama layout (an MoE or custom block)"
        a = attn.attn
        if a.sliding_window is not None or a.logit_softcap is not None or a.alibi_slopes is not None:
            return "sliding windows, soft-capped or ALiBi attention"
        if attn.rotary is not model.model.layers[0].self_attn.rotary:
            return "layers with different RoPE tables"
        if a.scale != model.model.layers[0].self_attn.attn.scale:
            return "layers with different attention scales"
        for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            if not hasattr(linear, "packed_weight") or type(linear.method).__name__ != "UnquantizedLinearMethod":
                return "quantized linear layers"
    if worker.elementwise_backend != "fused" or not isinstance(worker.attention, CpuPagedBackend):
        return "the fused element-wise kernels and the cpu_paged attention are not both in use"
    return None


def plain_weight(linear: torch.nn.Module) -> torch.Tensor:
    """The layer's [out, in] weight in the model's dtype, from oneDNN's packed copy when the plain one was freed."""
    if linear.weight.numel() > 0:
        return linear.weight.detach()
    return linear.packed_weight.to_dense()


class CpuDecodeStep:
    """The packed weights, the kernels' addresses and the step's buffers; `run` forwards a decode batch."""

    def __init__(self, model: torch.nn.Module, attention_layers: list, config) -> None:
        self.model = model
        inner = model.model
        first = inner.layers[0].self_attn
        self.rotary = first.rotary
        self.scale = first.attn.scale
        self.eps = inner.layers[0].input_layernorm.eps
        self.kv_dtype = attention_layers[0].k_cache.dtype
        self.shape = cpu_decoder_layers.Shape(
            rows=0, hidden=config.hidden_size, layers=len(inner.layers), heads=first.num_heads,
            kv_heads=first.num_kv_heads, head_dim=first.head_dim, rot=self.rotary.rotary_dim,
            inter=inner.layers[0].mlp.gate_up_proj.output_size // 2,
            kv_bf16=int(self.kv_dtype == torch.bfloat16))
        self._keep: list[torch.Tensor] = []  # everything whose address the table holds
        linears = [[("qkv", layer.self_attn.qkv_proj), ("o", layer.self_attn.o_proj),
                    ("gate_up", layer.mlp.gate_up_proj), ("down", layer.mlp.down_proj)] for layer in inner.layers]
        # bfloat16 copies when every layer weight holds bfloat16 values (a bfloat16 checkpoint served in float32):
        # half the bytes a step streams, the same products (one GEMV kernel serves every layer)
        self.weight_dtype = torch.bfloat16 if all(
            cpu_gemv.storage_dtype(plain_weight(linear)) == torch.bfloat16
            for layer in linears for _, linear in layer) else torch.float32
        table = []
        for layer, attn, layer_linears in zip(inner.layers, attention_layers, linears):
            pointers = {"input_norm": self._address(layer.input_layernorm.weight.detach()),
                        "post_norm": self._address(layer.post_attention_layernorm.weight.detach()),
                        "k_cache": attn.k_cache.data_ptr(), "v_cache": attn.v_cache.data_ptr()}
            for name, linear in layer_linears:
                packed = cpu_gemv.pack(plain_weight(linear), empty=huge_pages.empty, dtype=self.weight_dtype)
                self._keep.append(packed)
                pointers[f"{name}_weight"] = packed.data_ptr()
                pointers[f"{name}_bias"] = self._address(None if linear.bias is None else linear.bias.detach())
            table += [pointers[field] for field in cpu_decoder_layers.FIELDS]
        self.weights = torch.tensor(table, dtype=torch.int64)
        head = getattr(model, "lm_head", None)
        self.head_dtype = None
        if isinstance(head, ParallelLMHead):  # the LM head of few-row batches through the same GEMV
            weight = plain_weight(head)
            self.head_dtype = cpu_gemv.storage_dtype(weight)
            head.few_rows_weight = cpu_gemv.pack(weight, empty=huge_pages.empty, dtype=self.head_dtype)
        self.final_norm = inner.norm.weight.detach().float().contiguous()
        gemv = cpu_gemv.load()
        kernels = {"tgi_paged_attention": (cpu_attention.load(), "tgi_paged_attention"),
                   "tgi_gemv": (gemv, cpu_gemv.kernel_name(self.weight_dtype))}
        self.kernels = torch.tensor([address(*kernels.get(name, (cpu_elementwise.load(), name)))
                                     for name in cpu_decoder_layers.KERNELS], dtype=torch.int64)
        s = self.shape
        qkv_n = (s.heads + 2 * s.kv_heads) * s.head_dim
        widths = {"x": s.hidden, "res_a": s.hidden, "res_b": s.hidden, "h": s.hidden, "qkv": qkv_n,
                  "attn": s.heads * s.head_dim, "gate_up": 2 * s.inter, "act": s.inter}
        self.buffers = {name: torch.empty(MAX_ROWS, width) for name, width in widths.items()}
        self._loop = cpu_decoder_layers.load().tgi_decoder_layers

    @property
    def packed_bytes(self) -> int:
        """Bytes of the packed copies this step made (bfloat16 ones take half of copy_bytes' float32 bound)."""
        head = getattr(self.model, "lm_head", None)
        few = getattr(head, "few_rows_weight", None)
        return sum(t.numel() * t.element_size() for t in self._keep if t.dim() == 3) + \
            (0 if few is None else few.numel() * few.element_size())

    @staticmethod
    def copy_bytes(model: torch.nn.Module) -> int:
        """Bytes of the packed copy of every layer's linear weights and of the LM head, in float32 (an upper bound: a
        bfloat16 checkpoint's copy takes half)."""
        head = getattr(model, "lm_head", None)
        hidden = model.model.norm.weight.shape[0]
        total = 0
        if isinstance(head, ParallelLMHead):
            total += -(-head.shard_size // cpu_gemv.PANEL) * cpu_gemv.PANEL * hidden * 4
        for layer in model.model.layers:
            for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                           layer.mlp.down_proj):
                total += -(-linear.output_size // cpu_gemv.PANEL) * cpu_gemv.PANEL * linear.input_size * 4
        return total

    def _address(self, tensor: torch.Tensor | None) -> int:
        if tensor is None:
            return 0
        tensor = tensor.float().contiguous()
        self._keep.append(tensor)
        return tensor.data_ptr()

    @staticmethod
    def can_run(spans: list[SeqSpan]) -> bool:
        return 0 < len(spans) <= MAX_ROWS and all(len(span.token_ids) == 1 for span in spans)

    def run(self, inputs: ModelInputs) -> torch.Tensor:
        """The model's final hidden states [rows, hidden] of a decode batch, as `model(...)` would give, in float32
        (a bfloat16 model's too: the step's activations are float32, its weights and K/V the model's)."""
        meta = inputs.attention
        work, chunk_work = meta.extra["cpu_paged"][0], meta.extra["cpu_paged"][1]
        assert chunk_work is None and work is not None
        rows = inputs.input_ids.shape[0]
        hidden = self.buffers["h"][:rows]
        hidden.copy_(self.model.model.embed(inputs.input_ids, inputs.positions))
        cos, sin = (table[inputs.positions].float().contiguous() for table in (self.rotary.cos, self.rotary.sin))
        slots = meta.slot_mapping.contiguous()
        tables = meta.block_tables
        self.shape.rows = rows
        step = cpu_decoder_layers.Step(
            slots=slots.data_ptr(), cos=cos.data_ptr(), sin=sin.data_ptr(), work=work.data_ptr(),
            items=work.shape[0], tables=tables.data_ptr(), table_stride=tables.stride(0), block_size=meta.block_size,
            eps=self.eps, scale=self.scale)
        b = self.buffers
        status = self._loop(ctypes.byref(self.shape), ctypes.byref(step), self.weights.data_ptr(),
                            self.final_norm.data_ptr(), hidden.data_ptr(), b["x"].data_ptr(), b["res_a"].data_ptr(),
                            b["res_b"].data_ptr(), b["qkv"].data_ptr(), b["attn"].data_ptr(),
                            b["gate_up"].data_ptr(), b["act"].data_ptr(), self.kernels.data_ptr(),
                            max(1, torch.get_num_threads()))
        if status != 0:
            raise RuntimeError("the fused decode step's attention kernel refused its arguments")
        return b["x"][:rows].clone()


def build(worker) -> tuple[CpuDecodeStep | None, str]:
    """The fused step for this worker, or None; and what /info shows about the choice."""
    model = worker.model
    reason = unsupported_reason(worker)
    if reason is None:
        reason = cpu_gemv.self_check()
        reason = None if reason is None else f"the few-row GEMM failed its self-check ({reason})"
    copy = CpuDecodeStep.copy_bytes(model) if reason is None else 0
    if reason is None:
        budget = memory_limit().limit
        if copy > COPY_SHARE * budget:
            reason = (f"its weight copy ({copy / 2**20:.0f} MiB) is over {COPY_SHARE:.0%} of the memory budget "
                      f"({budget / 2**20:.0f} MiB)")
    if reason is not None:
        logger.info("fused CPU decode step off: %s", reason)
        return None, f"eager ({reason})"
    try:
        step = CpuDecodeStep(model, worker.attention_layers, worker.model_config)
        mismatch = _matches_eager(step, worker)
    except Exception as error:  # a build or kernel problem must not take the engine down
        mismatch = f"{type(error).__name__}: {error}"
    if mismatch is not None:
        logger.warning("fused CPU decode step off: %s", mismatch)
        return None, f"eager ({mismatch})"
    copy = step.packed_bytes
    stored = "bfloat16" if step.weight_dtype == torch.bfloat16 else "float32"
    if worker.dtype != torch.float32:
        stored += ", float32 activations over the bfloat16 model's K/V"
    logger.info("fused CPU decode step on for decode batches of up to %d rows (weight copy %.0f MiB, %s)", MAX_ROWS,
                copy / 2**20, stored)
    return step, f"fused (decode batches of 1-{MAX_ROWS} rows; weight copy {copy / 2**20:.0f} MiB, {stored})"


# how far the fused step's final hidden states may be from the eager forward's, relative to their largest: float32
# reorders sums; a bfloat16 model's eager layers round every activation to bfloat16, the step keeps them in float32
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 1e-1}   # SmolLM2 in bfloat16 on random K/V: 0.043


def _matches_eager(step: CpuDecodeStep, worker, tolerance: float | None = None) -> str | None:
    """Run a decode batch through the eager model and the fused step on the first blocks of the cache
    (start-up: no request owns a block yet); None when they agree, else what differed."""
    tolerance = TOLERANCE[worker.dtype] if tolerance is None else tolerance
    bs = worker.block_size
    spans, next_block = probe_decode_spans([1, bs + 3, 2 * bs - 1, 3 * bs], bs, first_token=11)
    if next_block > worker.num_kv_blocks:
        return f"a KV cache of {worker.num_kv_blocks} blocks is too small to check it on"
    generator = torch.Generator().manual_seed(0)
    caches = [cache for layer in worker.attention_layers for cache in (layer.k_cache, layer.v_cache)]
    with torch.inference_mode():
        for cache in caches:  # a finite context (an untouched cache may hold any bit pattern)
            cache[:next_block] = torch.randn(cache[:next_block].shape, generator=generator).to(cache.dtype)
        inputs = prepare_inputs(spans, bs, worker.device, worker.attention, worker.windows)
        eager = worker.model(inputs.input_ids, inputs.positions, inputs.attention).float()
        fused = step.run(inputs)  # both write the new tokens' k, v at the same slots before reading them
        for cache in caches:
            cache[:next_block] = 0.0
    error = (eager - fused).abs().max().item()
    if not error <= tolerance * (1.0 + eager.abs().max().item()):
        return f"it disagrees with the eager forward (max error {error:.3g})"
    return None
