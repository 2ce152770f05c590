"""EngineConfig: everything the launcher decides, passed to the engine core and the server."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class EngineConfig:
    # model
    model_id: str = ""                  # local snapshot directory
    revision: str | None = None
    dtype: str | None = None            # None = config's dtype on GPU, float32 on CPU
    load_format: str = "safetensors"    # "safetensors" | "dummy" (random weights, config shape)
    quantize: str | None = None         # fp8 | bitsandbytes* quantize at load; None = the checkpoint's own
    trust_remote_code: bool = False
    model_impl: str = "auto"            # "auto" | "native" | "transformers" (engine/models/transformers_backend.py)
    lora_adapters: list[tuple[str, str]] = field(default_factory=list)  # (name, PEFT adapter dir), index = position + 1
    enable_runtime_lora: bool = False   # POST /v1/load_lora_adapter, /v1/unload_lora_adapter (engine/lora/runtime.py)
    max_loras: int = 4                  # adapter slots with runtime LoRA (start-up adapters included)
    max_lora_rank: int = 16             # the largest rank a runtime adapter may have
    # parallelism
    num_shard: int = 1                  # tensor-parallel ranks (per pipeline stage)
    pipeline_parallel_size: int = 1     # stages, one per node (ranks started by srun: engine/external_launch.py)
    rank_timeout_s: float = 60.0        # a rank silent this long (or a collective this slow) ends every rank
    step_timeout_s: float = 300.0       # a tensor-parallel step this long is hung: the engine stops
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    device: str | None = None           # None = cuda if available else cpu
    # TGI limits (names and defaults follow text-generation-launcher)
    max_concurrent_requests: int = 128
    max_best_of: int = 2
    max_stop_sequences: int = 4
    max_top_n_tokens: int = 5
    max_input_tokens: int | None = None     # None = derived from the model (max_total_tokens - 1)
    max_total_tokens: int | None = None     # None = min(model max positions, 4096)
    max_batch_prefill_tokens: int | None = None  # None = max_input_tokens + 50
    max_batch_total_tokens: int | None = None    # None = what the KV cache holds
    max_batch_size: int | None = None
    waiting_served_ratio: float = 0.3
    max_new_tokens_default: int = 1024      # when a request sets no limit; 0 = all the room left (TGI)
    prefix_caching: bool = True             # share the KV blocks of equal prompt prefixes
    max_grammar_bytes: int = 512 * 1024     # a request's JSON schema or regex above this is a 422
    grammar_timeout_s: float = 10.0         # compiling one grammar longer than this is a 422
    speculate: int = 0                      # draft tokens per decode step (TGI's --speculate); 0 = off
    speculate_auto: bool = False            # --speculate auto: up to `speculate` drafts, per sequence while they pay
    speculative_model: str | None = None    # draft model snapshot dir (same tokenizer), its KV in the same blocks
    speculative_layers: int = 0             # draft with the model's first K layers (layer skip); 0 = n-gram drafts
    # memory
    cuda_memory_fraction: float = 1.0
    gpu_memory_utilization: float = 0.9     # of what cuda_memory_fraction leaves
    cpu_kv_cache_bytes: int | None = None  # KV budget on CPU; None = sized from the machine (engine/host_memory.py)
    block_size: int | None = None           # tokens per KV block; None = the attention backend's default
    enforce_eager: bool = False             # no CUDA graphs, no fused CPU decode step (--enforce-eager)
    cuda_graphs: list[int] | None = None    # decode batch sizes to capture; None = 1,2,4..256; [] = none
    piecewise_graphs: list[int] | None = None  # step token counts (engine/piecewise_graphs.py); None = the ladder
    async_scheduling: str = "auto"          # "auto" (CUDA, one node) | "on" | "off": engine/async_scheduling.py
    attention_backend: str = "auto"         # "auto" | "cpu_paged" | "portable" | "triton" | "flash-attn"
    cpu_gemm: str = "auto"                  # "auto" | "onednn" | "aten": linear layers on CPU
    cpu_elementwise: str = "auto"           # "auto" | "fused" | "aten": norm, RoPE, SiLU-and-mul on CPU
    gpu_elementwise: str = "auto"           # "auto" | "triton" | "aten": the same on CUDA
    # server
    hostname: str = "0.0.0.0"
    port: int = 3000
    api_key: str | None = field(default=None, repr=False)
    cors_allow_origin: list[str] = field(default_factory=list)
    json_output: bool = False
    served_model_name: str | None = None
    max_client_batch_size: int = 2048   # inputs per pooling request (embeddings, rerank, score)
    reasoning_parser: str = "auto"          # "auto" | "qwen3" | "deepseek_r1" | "gpt_oss" | "none" (engine/server/reasoning.py)
    # images (vision-language models, engine/multimodal)
    max_images_per_request: int = 8
    max_image_bytes: int = 20 * 2**20       # one image, encoded (a data: URL decoded, or an http(s) body)
    image_fetch_timeout_s: float = 10.0     # an http(s) image: connect + whole body
    image_fetch: str = "allow"              # http(s) image URLs: "allow" (fetched, any address) | "deny" (422)
    tool_call_parser: str = "auto"          # auto, or a name in structured/tool_calls.py's PARSERS
