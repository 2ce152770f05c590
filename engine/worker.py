"""RankWorker: one tensor-parallel rank (model shard + KV cache + forward); worker_main is ranks 1..N-1.

Every rank runs the same forward on the same spans; collectives inside the layers keep them in
lockstep, and only rank 0 ends up with logits.
"""
from __future__ import annotations

import collections
import logging
import os
import sys
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import torch

from engine import cpu_decode_step, cuda_graphs, distributed, graph_check, malloc_reuse, piecewise_graphs, pipeline
from engine.attention.block_tables import BlockTables
from engine.attention.flash import flash_version
from engine.attention.selection import choose_backend
from engine.batch import SeqSpan
from engine.config import EngineConfig
from engine.device_copy import list_to_device
from engine.host_memory import cpu_kv_budget
from engine.kv_budget import kv_budget
from engine.kv_prefault import KVPrefault
from engine.kernels import cpu_elementwise
from engine.layers import cpu_gemm, quantization
from engine.layers.quantization import fp8, wna16
from engine.lora import backend as lora_backend
from engine.lora.adapter import adaptable_modules, read_adapter
from engine.lora.batch import order_by_adapter
from engine.lora.stack import AdapterSet
from engine.model_config import ModelConfig
from engine.model_inputs import prepare_inputs
from engine.multimodal import mrope
from engine.multimodal.encoder_cache import EncoderCache
from engine.models import model_class
from engine.parallel_layout import ParallelLayout
from engine.rank_watch import start_heartbeat
from engine.spec_decode.draft_model import DraftModel
from engine.spec_decode.head_drafter import DraftRow
from engine.spec_decode.heads import load_heads, speculative_kind
from engine.spec_decode.layer_skip import check_layer_skip, forward_first_layers
from engine.weights import load_dummy, load_safetensors

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


# Collectives of ranks srun started: loading a large model's shard takes long on some ranks, and a dead rank
# is caught by the heartbeats (engine/external_launch.py), not by this timeout.
LAUNCHED_GROUP_TIMEOUT_S = 1800.0


def available_cpus() -> int:
    """Cores this process may use (a Slurm allocation, not the whole node)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def resolve_device(name: str | None, rank: int) -> torch.device:
    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":  # rank r of a node uses the r-th GPU after the configured one
        device = torch.device("cuda", (device.index or 0) + rank)
    return device


def gpu_index(layout: ParallelLayout) -> int:
    """The local rank's GPU, or GPU 0 when the launcher shows each task only its own (srun --gpus-per-task)."""
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return layout.local_rank if visible > layout.local_rank else 0


def resolve_dtype(name: str | None, model_config: ModelConfig, device: torch.device) -> torch.dtype:
    """`--dtype`, else the checkpoint's dtype on CUDA and `cpu_default_dtype` on CPU."""
    if name is None:
        name = model_config.torch_dtype if device.type == "cuda" else cpu_default_dtype(model_config.torch_dtype)
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def cpu_default_dtype(checkpoint: str) -> str:
    """bfloat16 for a bfloat16 checkpoint on a CPU that computes in bfloat16 natively (AVX512-BF16 or AMX), as
    vLLM's CPU backend: the weights as stored, half the bytes a decode step streams, oneDNN's bfloat16 GEMMs for
    prefill and the fused decode step (float32 activations, engine/cpu_decode_step.py); on SmolLM2 in bfloat16 1.2-1.6x
    the float32 engine's output tok/s (docs/benchmarks.md). Else float32: lossless for any checkpoint, and the only
    fast path where bfloat16 would be emulated (a bfloat16 checkpoint still streams its weights in bfloat16 there:
    engine/kernels/cpu_gemv.py)."""
    if checkpoint == "bfloat16" and (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()):
        return "bfloat16"
    return "float32"


# tokens from which a CPU step counts as prefill-heavy: a few long GEMMs while HTTP idles (engine/launcher.py)
class RankWorker:
    """`layout`: this rank's place among ranks an external launcher started (engine/external_launch.py);
    None = rank `rank` of the num_shard tensor-parallel ranks this engine spawned itself."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, rank: int,
                 store: torch.distributed.Store | None, layout: ParallelLayout | None = None) -> None:
        self.config, self.model_config, self.rank = config, model_config, rank
        self.layout = layout or ParallelLayout.single_node(rank, config.num_shard)
        self.device = resolve_device(config.device, gpu_index(self.layout) if layout else rank)
        self.dtype = resolve_dtype(config.dtype, model_config, self.device)
        if config.dtype is None and rank == 0:
            logger.info("dtype %s (no --dtype: the default for a %s checkpoint on %s)", str(self.dtype)[6:],
                        model_config.torch_dtype, self.device.type)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        distributed.init_parallel(self.layout, store, self.device,
                                  timeout_s=LAUNCHED_GROUP_TIMEOUT_S if layout else 300.0)
        wna16.reset_report()
        self.model = self._load_model()
        self.encoder_cache = EncoderCache(self.model.encode_images) if getattr(self.model, "is_multimodal", False) \
            else None
        if config.speculative_layers:
            check_layer_skip(self.model, config.speculative_layers, model_config.num_hidden_layers)
        kind = speculative_kind(config.speculative_model)
        self.draft = DraftModel(config.speculative_model, self.device, self.dtype) if kind == "draft" else None
        # Medusa / EAGLE-3: rank 0 alone drafts from the target's hidden states
        self.heads = load_heads(kind, config.speculative_model, self.model, model_config, self.device, self.dtype) \
            if kind in ("medusa", "eagle3") and self.rank == 0 else None
        self.lora, self.lora_backend, self.lora_report = self._load_adapters()
        self.linear_backend = cpu_gemm.choose(config.cpu_gemm, self.device, self.dtype)
        if self.linear_backend == "onednn":
            cpu_gemm.prepack_model(self.model)
        self.elementwise_backend = self._choose_elementwise()
        self.quant_report = {**wna16.kernel_report(), **fp8.kernel_report()}  # quantized kernels' self-checks
        self.attention_layers = self.model.attention_layers()
        self.windows = {layer.sliding_window for layer in self.attention_layers}
        self.block_tables = BlockTables(self.device)   # kept on the device, updated by what changed
        self.kv_prefault: KVPrefault | None = None     # CPU: the cache's pages fault in just ahead of use
        self.kv_eager_blocks: int | None = None         # CPU: blocks the cache grows through freely (BlockManager)
        if self.draft is not None:
            self.windows |= self.draft.windows
        self.attention, self.block_size, self.attention_report = self._choose_backend()
        self.attention_backend = self.attention.name
        self.graph_sizes = self._graph_sizes()
        self.num_kv_blocks = self._allocate_kv_cache()
        self.block_tables.num_blocks = self.num_kv_blocks  # each id range-checked as it reaches the table
        self.graphs = self._capture_graphs() if self.graph_sizes else None
        self.piecewise = self._capture_piecewise()
        # the target forwards by path ("decode_graph", "piecewise_graphs", "cpu_decode_step", "eager"): /metrics
        self.forward_steps: collections.Counter[str] = collections.Counter()
        self.decode_step, self.decode_step_report = cpu_decode_step.build(self)

    def _choose_elementwise(self) -> str:
        """Fused norm / RoPE / SiLU-and-mul kernels for this device ("fused" C++ on CPU, "triton" on CUDA),
        installed in the model's layers, or "aten" (torch's ops)."""
        if self.device.type == "cuda":
            from engine.kernels import triton_elementwise  # imported late: TRITON_INTERPRET is read at import
            kernels, wanted = triton_elementwise, self.config.gpu_elementwise
        else:
            kernels, wanted = cpu_elementwise, self.config.cpu_elementwise
        backend = kernels.choose(wanted, self.device, self.dtype)
        if backend != "aten" and not kernels.install(self.model):
            return "aten"  # a model without the layers the kernels replace
        return backend

    def _load_model(self) -> torch.nn.Module:
        quant = quantization.resolve(self.model_config.quantization_config, self.config.quantize)
        if quant is not None:
            quant.check_device(self.device, self.dtype)
            logger.info("quantization: %r", quant)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device), quantization.building(quant):
                model = model_class(self.model_config)(self.model_config)
        finally:
            torch.set_default_dtype(default_dtype)
        if self.config.load_format == "dummy":
            load_dummy(model)
        elif self.config.load_format == "safetensors":
            load_safetensors(model, self.config.model_id, model.packed_modules_mapping,
                             skip=model.skipped_checkpoint_tensors())
        else:
            raise ValueError(f"unknown load format {self.config.load_format!r}; use safetensors or dummy")
        return model.eval()

    def _load_adapters(self) -> tuple[AdapterSet | None, str, dict[str, str]]:
        """The --lora-adapters on this rank's layers, and the LoRA backend every rank agreed on."""
        if not self.config.lora_adapters and not self.config.enable_runtime_lora:
            return None, "none", {}
        if self.layout.pp_size > 1:
            raise ValueError("LoRA adapters with --pipeline-parallel-size > 1 are not supported yet")
        adapters = [read_adapter(name, path) for name, path in self.config.lora_adapters]  # checked by the runner
        backend, report = lora_backend.choose(self.device, self.dtype,
                                              agree=lambda ok: distributed.all_reduce_min(int(ok), self.device) == 1)
        if self.rank == 0:
            logger.info("LoRA backend %s, checked against the reference: %s", backend,
                        ", ".join(f"{name} {verdict}" for name, verdict in report.items()))
        if not self.config.enable_runtime_lora:
            return AdapterSet(self.model, adapters, backend, self.dtype, self.device), backend, report
        return AdapterSet(self.model, adapters, backend, self.dtype, self.device,
                          slots=max(self.config.max_loras, len(adapters)), rank=self.config.max_lora_rank,
                          targets=adaptable_modules(self.model_config)), backend, report

    def load_lora(self, slot: int, name: str, path: str) -> None:
        """A runtime adapter (checked by the engine) into `slot`, between steps."""
        self.lora.load_slot(slot, read_adapter(name, path))

    def unload_lora(self, slot: int) -> None:
        self.lora.clear_slot(slot)

    def _choose_backend(self):
        start = time.monotonic()
        backend, block_size, report = choose_backend(
            self.config.attention_backend, self.device, self.dtype, self.attention_layers, self.config.block_size,
            agree=lambda ok: distributed.all_reduce_min(int(ok), self.device) == 1)
        for layer in self.attention_layers:
            layer.impl = backend
        if self.rank == 0:
            logger.info("attention backend %s (KV blocks of %d tokens), checked against the reference in %.1f s: %s",
                        backend.name, block_size, time.monotonic() - start,
                        ", ".join(f"{name} {verdict}" for name, verdict in report.items()))
        return backend, block_size, report

    def _graph_sizes(self) -> list[int]:
        """Decode batch sizes to capture as CUDA graphs here ([] = eager only), with the reason logged."""
        config = self.config
        sizes = cuda_graphs.batch_sizes(config.cuda_graphs, config.enforce_eager, config.max_batch_size)
        if not sizes or self.device.type != "cuda":
            return []
        reason = None
        if self.lora is not None:
            reason = "LoRA adapters are loaded (their per-token adapter map is not captured)"
        elif getattr(self.model, "supports_cuda_graphs", True) is False:
            reason = "not captured for models on the transformers backend"
        elif self.draft is not None or self.heads is not None:
            reason = "a draft model or heads run after the target (--speculative-model)"
        elif not self.attention.supports_cuda_graphs:
            reason = f"the {self.attention.name} attention backend reads host-side lengths"
        elif config.num_shard > 1 or self.layout.pp_size > 1:
            reason = "not implemented with tensor or pipeline parallelism"
        else:
            reason = graph_check.uncapturable(self.model, self.device, self.dtype)
        if reason:
            logger.info("decode CUDA graphs off: %s", reason)
            return []
        return sizes

    def _capture_graphs(self) -> cuda_graphs.DecodeGraphs | None:
        max_tokens = self.config.max_total_tokens or min(self.model_config.max_position_embeddings, 4096)
        graphs = cuda_graphs.DecodeGraphs(self.model, self.attention, self.graph_sizes,
                                          -(-max_tokens // self.block_size), self.block_size,
                                          scratch_block=self.num_kv_blocks, device=self.device)
        start = time.monotonic()
        try:
            graphs.capture()
        except Exception as error:  # a capture problem must not take the engine down
            detail = flash_version() if self.attention.name == "flash-attn" else self.attention.name
            logger.warning("capturing decode CUDA graphs failed with %s (%s): running eagerly", detail, error)
            return None
        tolerance = graph_check.tolerance(self.dtype)
        if not cuda_graphs.matches_eager(graphs, self.attention_layers, self.windows, tolerance):
            return None
        logger.info("decode CUDA graphs for batch sizes %s captured in %.1f s", graphs.batch_sizes,
                    time.monotonic() - start)
        return graphs

    def _piecewise_sizes(self) -> list[int]:
        """Step token counts to capture as piecewise graphs here ([] = eager), the same on every rank."""
        config = self.config
        off_cuda = self.device.type != "cuda"
        if config.piecewise_graphs is None and off_cuda and not piecewise_graphs.forced_off_cuda():
            return []   # off CUDA only an explicit list, which runs the split forward uncaptured (tests)
        largest_step = (config.max_batch_prefill_tokens or 4096 + 50) + (config.max_batch_size or 256)
        sizes = piecewise_graphs.token_sizes(config.piecewise_graphs, config.enforce_eager, largest_step,
                                             config.max_batch_size)
        if not sizes:
            return []
        if self.lora is not None and config.piecewise_graphs is None:   # larger LoRA steps: the grouped GEMMs
            sizes = [size for size in sizes if size <= lora_backend.GROUPED_FROM_TOKENS]
        reason = None
        if getattr(self.model, "supports_cuda_graphs", True) is False or self.encoder_cache is not None:
            reason = "not captured for models on the transformers backend"
        elif self.layout.pp_size > 1:
            reason = "not implemented with pipeline parallelism"
        elif not off_cuda:
            reason = graph_check.uncapturable(self.model, self.device, self.dtype)
        if reason:
            logger.info("piecewise CUDA graphs off: %s", reason)
            return []
        return sizes

    def _capture_piecewise(self) -> piecewise_graphs.PiecewiseGraphs | None:
        """The target's pieces (and a draft model's own, in its own pool: the target's output must outlive
        the draft's forward). Every rank captures; they stay only if every rank's captures and checks passed."""
        sizes = self._piecewise_sizes()
        if not sizes:
            return None
        start = time.monotonic()
        tolerance = graph_check.tolerance(self.dtype)
        models = [(self.model, self.attention_layers, self.windows)]
        if self.draft is not None:
            models.append((self.draft.model, self.draft.attention_layers, self.draft.windows))
        captured = []
        for model, layers, windows in models:
            target = model is self.model
            lora = self.lora.batch if self.lora is not None and target else None
            taps = self.heads if target and hasattr(self.heads, "graph_captured") else None  # EAGLE-3, rank 0
            try:
                graphs = piecewise_graphs.PiecewiseGraphs(model, sizes, self.device, self.dtype, lora, taps)
                graphs.capture()
                passed = piecewise_graphs.matches_eager(graphs, layers, self.attention, self.block_size, windows,
                                                        self.num_kv_blocks, tolerance)
            except Exception as error:
                if distributed.tp_size() > 1:   # the peers are inside collectives this rank left: see graph_check
                    raise RuntimeError(f"capturing piecewise CUDA graphs failed on rank {self.rank} ({error}); "
                                       "every tensor-parallel rank must capture the same collectives: start "
                                       "with --piecewise-graphs 0 to run these steps eagerly") from error
                logger.warning("capturing piecewise CUDA graphs failed (%s): mixed steps run eagerly", error)
                return None     # a capture problem must not take a single-rank engine down
            if distributed.all_reduce_min(int(passed), self.device) != 1:   # every rank goes on, or none
                return None
            captured.append(graphs)
        if self.draft is not None:
            self.draft.piecewise = captured[1]
        if self.rank == 0:
            logger.info("piecewise CUDA graphs for %d token counts up to %d captured in %.1f s%s", len(sizes),
                        captured[0].max_tokens, time.monotonic() - start,
                        " (and the draft model's)" if self.draft is not None else "")
        return captured[0]

    def _allocate_kv_cache(self) -> int:
        cfg = self.model_config
        layer0 = self.attention_layers[0]
        num_layers = len(self.attention_layers)  # this pipeline stage's layers
        bytes_per_block = (2 * num_layers * self.block_size * layer0.num_kv_heads * cfg.head_dim
                           * self.dtype.itemsize)
        if self.draft is not None:  # the draft's cache: the same blocks, its own layers
            bytes_per_block += self.draft.bytes_per_block(self.block_size)
        if hasattr(self.heads, "bytes_per_block"):  # EAGLE-3's draft layer, on rank 0
            bytes_per_block += self.heads.bytes_per_block(self.block_size)
        if self.device.type == "cuda":
            budget = self._gpu_kv_budget()
        elif self.config.cpu_kv_cache_bytes is not None:
            budget = self.config.cpu_kv_cache_bytes
        else:  # this rank's share of the node's memory, no more than max_total_tokens per concurrent request
            per_token = bytes_per_block // self.block_size
            most = self.config.max_concurrent_requests * (self.config.max_total_tokens or cfg.max_position_embeddings)
            budget = cpu_kv_budget(per_token, most, self.layout.tp_size, fraction=self.config.cuda_memory_fraction)
        scratch = 1 if self.graph_sizes else 0  # one block past the scheduler's: padding rows of decode graphs
        num_blocks = distributed.all_reduce_min(int(budget // bytes_per_block), self.device) - scratch
        if num_blocks < 1:
            raise RuntimeError(f"no memory left for the KV cache (one block needs {bytes_per_block} bytes); "
                               "raise --cuda-memory-fraction / cpu_kv_cache_bytes or use more shards")
        self.kv_cache = torch.empty(2, num_layers, num_blocks + scratch, self.block_size,
                                    layer0.num_kv_heads, cfg.head_dim, dtype=self.dtype, device=self.device)
        self.kv_cache[:, :, 0].zero_()  # padded gathers read block 0: keep it finite
        if self.device.type == "cpu":
            self.kv_prefault = KVPrefault(self.kv_cache, block_dim=2)
            self.kv_eager_blocks = self.kv_prefault.ahead_blocks
            malloc_reuse.apply()
        for i, layer in enumerate(self.attention_layers):
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
        if self.draft is not None:
            self.draft.allocate(num_blocks + scratch, self.block_size, self.attention)
        if hasattr(self.heads, "allocate"):
            self.heads.allocate(num_blocks + scratch, self.block_size, self.attention)
        if self.rank == 0:
            logger.info("KV cache: %d blocks of %d tokens (%.1f MiB per rank), attention backend %s",
                        num_blocks, self.block_size, num_blocks * bytes_per_block / 2**20, self.attention_backend)
        return num_blocks

    def _gpu_kv_budget(self) -> float:
        """Bytes left for the KV cache after a warm-up forward at the largest prefill."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.warmup()
        torch.cuda.empty_cache()  # else the cached activation blocks count in `total - free` and in `peak` too
        free, total = torch.cuda.mem_get_info(self.device)
        stats = torch.cuda.memory_stats(self.device)
        peak, current = stats["allocated_bytes.all.peak"], stats["allocated_bytes.all.current"]
        return kv_budget(total, free, peak, current, torch.cuda.memory_reserved(self.device),
                         self.config.cuda_memory_fraction, self.config.gpu_memory_utilization)

    @torch.inference_mode()
    def warmup(self) -> None:
        cfg = self.model_config
        num_tokens = min(self.config.max_batch_prefill_tokens or 4096 + 50, cfg.max_position_embeddings)
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        positions = torch.arange(num_tokens, device=self.device)
        if self.layout.pp_size > 1:  # this stage alone, on zeros where its peers' tensors would be
            rows = torch.arange(max(0, num_tokens - 1024), num_tokens, device=self.device)
            inputs = pipeline.ModelInputs(input_ids, positions, None, rows)
            pipeline.forward_stage(self.model, self.layout, inputs, self.dtype, communicate=False)
        else:
            hidden = self.model(input_ids, positions, None)
            self.model.compute_logits(hidden[-min(num_tokens, 1024):])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def execute(self, spans: list[SeqSpan], num_layers: int | None = None, draft: bool = False,
                input_ids: torch.Tensor | None = None, num_device_ids: int = 0) -> torch.Tensor | None:
        """Forward the spans; rank 0 gets float32 logits of the requested rows, other ranks None.
        `num_layers`: only the first layers, then the final norm and LM head (layer-skip drafting).
        `draft`: the draft model alone; else the draft model (if any) follows the target on the same spans.
        `input_ids` [k]: the first k spans' tokens on the device (one rank, decode spans of one token each),
        read in place of their `token_ids` (engine/async_scheduling.py: the picks of a step still on their
        way to the host); the spans after them are prefill chunks whose tokens the host has. Under tensor
        parallelism rank 0 has them and broadcasts them; `num_device_ids`: on the other ranks, how many."""
        if self.kv_prefault is not None and not self.kv_prefault.done and spans:
            self.kv_prefault.note(max(span.block_table[(span.start_pos + len(span.token_ids) - 1) // self.block_size]
                                      for span in spans))
        if self.layout.pp_size > 1:
            return pipeline.run_stage(self, spans)
        if num_device_ids:  # a tensor rank after the first: the ids come from rank 0's device
            input_ids = torch.empty(num_device_ids, dtype=torch.int64, device=self.device)
        if input_ids is not None and self.layout.tp_size > 1:
            input_ids = distributed.broadcast_from_rank0(input_ids.to(torch.int64).contiguous())
        if num_layers is None and not draft and self.graphs is not None and self.graphs.can_run(spans):
            self.forward_steps["decode_graph"] += 1
            logits = self.model.compute_logits(self.graphs.run(spans, input_ids))
            return None if logits is None else logits.float()
        restore, given = None, spans
        if self.lora is not None:  # each adapter's tokens in one slice: a few GEMMs per adapter, no gathers
            spans, restore = order_by_adapter(spans)
        inputs = prepare_inputs(spans, self.block_size, self.device, self.attention, self.windows,
                                self.block_tables)
        if input_ids is not None and restore is None:
            inputs.input_ids[:len(input_ids)].copy_(input_ids)
        elif input_ids is not None:     # the decodes moved with their adapter's tokens: each to its new row
            first, row = {}, 0
            for span in spans:
                first[id(span)], row = row, row + len(span.token_ids)
            rows = list_to_device([first[id(span)] for span in given[:len(input_ids)]], torch.int64, self.device)
            inputs.input_ids.index_copy_(0, rows, input_ids.to(inputs.input_ids.dtype))
        try:
            if self.lora is not None:
                self.lora.set_batch(spans, self.device)
            if draft:
                hidden = self.draft.forward(inputs)
            elif self.encoder_cache is not None and num_layers is None:
                self.forward_steps["eager"] += 1
                hidden = self.model(inputs.input_ids, mrope.step_positions(spans, inputs.positions), inputs.attention,
                                    self.encoder_cache.embeddings(spans))
            elif num_layers is None and self.decode_step is not None and self.decode_step.can_run(spans):
                self.forward_steps["cpu_decode_step"] += 1
                hidden = self.decode_step.run(inputs)  # no LoRA, drafts or heads: the step is not built with them
            elif num_layers is None:
                if self.piecewise is not None and self.piecewise.can_run(spans, inputs.input_ids.shape[0]):
                    self.forward_steps["piecewise_graphs"] += 1
                    hidden = self.piecewise.run(inputs)     # a static buffer: read before the next step
                else:
                    self.forward_steps["eager"] += 1
                    hidden = self.model(inputs.input_ids, inputs.positions, inputs.attention)
                if self.draft is not None:
                    self.draft.forward(inputs)
                if self.heads is not None:
                    self.heads.observe(spans, hidden, inputs.logits_rows)
            else:
                hidden = forward_first_layers(self.model, inputs.input_ids, inputs.positions, inputs.attention,
                                              num_layers)
        finally:
            if self.lora is not None:
                self.lora.clear_batch()
        if inputs.logits_rows.numel() == 0:
            return hidden.new_zeros(0, self.model_config.vocab_size, dtype=torch.float32)
        logits = (self.draft.model if draft else self.model).compute_logits(hidden[inputs.logits_rows])
        if logits is not None and restore is not None:
            logits = logits[list_to_device(restore, torch.int64, logits.device)]
        return None if logits is None else logits.float()

    @torch.inference_mode()
    def encode_images(self, spans: list[SeqSpan]) -> dict[int, str]:
        """Run the vision encoder for the step's requests whose images are not encoded yet; seq_id -> why for
        those it failed on (engine/multimodal/encoder_cache.py). A text-only model has nothing to encode."""
        return {} if self.encoder_cache is None else self.encoder_cache.encode(spans)

    @torch.inference_mode()
    def draft_heads(self, rows: list[DraftRow]) -> list[list[int]]:
        """Medusa / EAGLE-3 drafts for the step's drafted decode rows (rank 0)."""
        return self.heads.draft(rows, prepare=lambda spans: prepare_inputs(
            spans, self.block_size, self.device, self.attention, self.windows, self.block_tables))

    def close(self) -> None:
        if self.kv_prefault is not None:
            self.kv_prefault.close()
        self.graphs = self.piecewise = None
        self.heads = None
        for layer in self.attention_layers:
            layer.k_cache = layer.v_cache = torch.tensor([])
        self.kv_cache = None
        self.model = None
        if self.draft is not None:
            self.draft.close()
        distributed.destroy_tensor_parallel()


def worker_main(config: EngineConfig, model_config: ModelConfig, rank: int, master: tuple[str, int],
                conn: Connection, beats: Any = None) -> None:
    """Entry point of a spawned rank: build the shard, then run spans until told to stop."""
    parent = os.getppid()
    worker = None
    failed = False
    if beats is not None:
        start_heartbeat(beats, rank)
    try:
        device = resolve_device(config.device, rank)
        if device.type == "cpu":  # ranks share the node's cores
            torch.set_num_threads(max(1, available_cpus() // config.num_shard))
        else:   # a busy or broken GPU fails here, before rank 0 waits for this rank in the rendezvous
            torch.cuda.set_device(device)
            torch.empty(1, device=device)
        store = distributed.create_store(master[0], master[1], config.num_shard, is_master=False)
        conn.send(("joining",))  # imports done and store reached: rank 0 may enter the rendezvous
        worker = RankWorker(config, model_config, rank, store)
        conn.send(("ready", worker.num_kv_blocks))
        while True:
            if not conn.poll(1.0):
                if os.getppid() != parent:  # rank 0 is gone: do not linger as an orphan
                    break
                continue
            command, *args = conn.recv()
            if command == "stop":
                break
            if command == "run":
                worker.execute(*args)
            elif command in ("load_lora", "unload_lora"):
                getattr(worker, command)(*args)
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass
    except BaseException:
        failed = True
        try:
            conn.send(("error", f"rank {rank}: {traceback.format_exc()}"))
        except OSError:
            pass
    finally:
        if worker is not None:
            worker.close()
    if failed:
        sys.exit(1)     # rank 0 reports "rank N died (exit code 1)" beside the error sent above
