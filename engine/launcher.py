"""`python -m engine`: text-generation-launcher's flags (each with its env twin) -> EngineConfig -> LLMEngine -> uvicorn."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import signal
import socket
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from engine import gc_tuning
from engine.config import EngineConfig

logger = logging.getLogger("engine.launcher")

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse's usage dump buries the one line that matters
        self.exit(2, f"{self.prog}: error: {message}\n(run `{self.prog} --help` for the flags)\n")


def _size(text: str) -> int:
    """Bytes from '536870912', '512MiB', '2G' (powers of 1024)."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}; use bytes or a K/M/G/T suffix, e.g. 2GiB")
    number, unit, _ = match.groups()
    power = "kmgt".find(unit.lower()) + 1 if unit else 0
    return int(float(number) * 1024**power)


def _batch_sizes(text: str) -> list[int]:
    """TGI's --cuda-graphs: '1,2,4,8' (0 or empty = no graphs)."""
    try:
        sizes = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid batch sizes {text!r}; use e.g. 1,2,4,8 or 0 for none") from None
    if any(size < 0 for size in sizes):
        raise argparse.ArgumentTypeError(f"invalid batch sizes {text!r}: sizes are >= 0")
    return [size for size in sizes if size > 0]


def _block_size(text: str) -> int:
    try:
        size = int(text)
    except ValueError:
        size = 0
    if size < 1 or size & (size - 1):
        raise argparse.ArgumentTypeError(f"invalid block size {text!r}; use a power of two, e.g. 16")
    return size


AUTO_MAX_DRAFTS = 4     # --speculate auto: draft tokens per step at most


def _speculate(text: str) -> int | str:
    if text.strip().lower() == "auto":
        return "auto"
    try:
        num = int(text)
    except ValueError:
        num = -1
    if not 0 <= num <= 16:
        raise argparse.ArgumentTypeError(f"invalid speculate {text!r}; use 0 (off) to 16 draft tokens per step, "
                                         "or auto")
    return num


def _speculative_layers(text: str) -> int:
    try:
        num = int(text)
    except ValueError:
        num = -1
    if num < 0:
        raise argparse.ArgumentTypeError(f"invalid speculative layers {text!r}; use K >= 1, fewer than the "
                                         "model's layers (0 = off)")
    return num


# engine/attention/selection.py's CHOICES, spelled out so that --help imports no torch (a test keeps them equal)
ATTENTION_CHOICES = ["auto", "flash-attn", "triton", "cpu_paged", "portable", "flash", "sdpa", "torch"]


def _lora_adapters(text: str) -> list[tuple[str, str]]:
    from engine.lora.names import parse_lora_adapters  # torch-free

    try:
        return parse_lora_adapters(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"invalid boolean {text!r}; use true or false")


# (flag and aliases, env twin, argparse keywords); the env value is the default, a flag overrides it
_FLAGS: list[tuple[tuple[str, ...], str, dict[str, Any]]] = [
    (("--model-id",), "MODEL_ID", dict(help="local snapshot directory, or a Hub id already in the local HF cache")),
    (("--revision",), "REVISION", dict(help="Hub revision when --model-id is a Hub id")),
    (("--served-model-name",), "SERVED_MODEL_NAME", dict(help="name reported by /info and /v1/models")),
    (("--dtype",), "DTYPE", dict(choices=["float16", "bfloat16", "float32"], help="weights and activations dtype")),
    (("--load-format",), "LOAD_FORMAT", dict(default="safetensors", choices=["safetensors", "dummy"],
                                             help="'dummy' = random weights of the checkpoint's shape")),
    (("--quantize",), "QUANTIZE", dict(help="fp8 | bitsandbytes | bitsandbytes-nf4 | bitsandbytes-fp4 quantize "
                                            "a float checkpoint at load; gptq | awq | compressed-tensors "
                                            "checkpoints are read from their config without it")),
    (("--lora-adapters",), "LORA_ADAPTERS",
     dict(type=_lora_adapters, help="PEFT LoRA adapters served beside the base model: NAME=DIR,NAME2=DIR2 (a bare DIR "
                                    "is named after its directory); a request picks one with parameters.adapter_id "
                                    "or OpenAI's `model`")),
    (("--enable-runtime-lora",), "ENABLE_RUNTIME_LORA",
     dict(default=False, type=_bool, nargs="?", const=True,
          help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's shape) within --max-loras "
               "slots of rank <= --max-lora-rank")),
    (("--max-loras",), "MAX_LORAS", dict(default=4, type=int, help="LoRA adapter slots with --enable-runtime-lora "
                                                                   "(start-up adapters included)")),
    (("--max-lora-rank",), "MAX_LORA_RANK", dict(default=16, type=int, help="the largest rank of an adapter loaded "
                                                                            "at run time")),
    (("--trust-remote-code",), "TRUST_REMOTE_CODE", dict(default=False, type=_bool, nargs="?", const=True,
                                                         help="allow custom tokenizer code from the snapshot")),
    (("--num-shard",), "NUM_SHARD", dict(default=1, type=int, help="tensor-parallel ranks (one GPU each)")),
    (("--pipeline-parallel-size",), "PIPELINE_PARALLEL_SIZE",
     dict(default=1, type=int, help="pipeline stages, one per node: needs one process per GPU started by srun or "
                                    "torchrun (ranks from SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID or "
                                    "RANK/WORLD_SIZE/LOCAL_RANK); --num-shard is then the GPUs per node")),
    (("--rank-timeout",), "RANK_TIMEOUT",
     dict(default=60.0, type=float, help="seconds without a heartbeat from a rank before every rank exits")),
    (("--step-timeout",), "STEP_TIMEOUT",
     dict(default=300.0, type=float, help="seconds one tensor-parallel step may run before the engine counts a "
                                          "rank hung and exits (--num-shard > 1)")),
    (("--master-addr",), "MASTER_ADDR", dict(default="127.0.0.1", help="torch.distributed rendezvous address")),
    (("--master-port",), "MASTER_PORT", dict(default=29500, type=int, help="torch.distributed rendezvous port")),
    (("--device",), "DEVICE", dict(help="cpu or cuda (default: cuda when available)")),
    (("--hostname",), "HOSTNAME", dict(default="0.0.0.0", help="address to listen on")),
    (("--port",), "PORT", dict(default=3000, type=int, help="port to listen on; 0 picks a free one")),
    (("--port-attempts",), "PORT_ATTEMPTS",
     dict(default=1, type=int, help="when --port is taken, bind the next free one, trying this many ports in all "
                                    "(the log and --ready-file say which one)")),
    (("--ready-file",), "READY_FILE", dict(help='write {"host", "port", "pid"} here (atomically) once serving')),
    (("--api-key",), "API_KEY", dict(help="require 'Authorization: Bearer KEY' on generation routes; prefer the env "
                                          "variable, argv is visible to every user in ps")),
    (("--json-output",), "JSON_OUTPUT", dict(default=False, type=_bool, nargs="?", const=True,
                                             help="log as JSON lines")),
    (("--max-concurrent-requests",), "MAX_CONCURRENT_REQUESTS",
     dict(default=128, type=int, help="requests in the system before new ones get 429")),
    (("--max-best-of",), "MAX_BEST_OF", dict(default=2, type=int, help="largest best_of accepted")),
    (("--max-stop-sequences",), "MAX_STOP_SEQUENCES", dict(default=4, type=int, help="stop sequences per request")),
    (("--max-top-n-tokens",), "MAX_TOP_N_TOKENS", dict(default=5, type=int, help="largest top_n_tokens accepted")),
    (("--max-input-tokens", "--max-input-length"), "MAX_INPUT_TOKENS",
     dict(type=int, help="longest prompt (default: max-total-tokens - 1; env MAX_INPUT_LENGTH works too)")),
    (("--max-total-tokens",), "MAX_TOTAL_TOKENS",
     dict(type=int, help="prompt + generated tokens per request (default: min(model context, 4096))")),
    (("--max-batch-prefill-tokens",), "MAX_BATCH_PREFILL_TOKENS",
     dict(type=int, help="prefill tokens per step (default: max input tokens + 50; at most 1024 on CPU)")),
    (("--max-batch-total-tokens",), "MAX_BATCH_TOTAL_TOKENS",
     dict(type=int, help="tokens of all running requests (default: what the KV cache holds)")),
    (("--max-batch-size",), "MAX_BATCH_SIZE", dict(type=int, help="requests per step")),
    (("--max-grammar-bytes",), "MAX_GRAMMAR_BYTES",
     dict(default=512 * 1024, type=_size, help="largest JSON schema or regex a request may constrain its output "
                                               "with (422 beyond), e.g. 512KiB")),
    (("--grammar-timeout",), "GRAMMAR_TIMEOUT",
     dict(default=10.0, type=float, help="seconds one request grammar may take to compile, off the event loop "
                                         "(422 beyond; the result is cached either way)")),
    (("--speculate",), "SPECULATE",
     dict(default=0, type=_speculate, help="speculative decoding: draft tokens per step (n-gram drafts from the "
                                           "prompt and output unless --speculative-layers), verified in one "
                                           "forward (0 = off); auto = up to 4, per request while drafting pays")),
    (("--speculative-model",), "SPECULATIVE_MODEL",
     dict(default=None, help="draft the --speculate tokens with this smaller model (a snapshot directory with the "
                             "same tokenizer; its KV cache shares the block budget), or with the Medusa heads "
                             "(medusa_lm_head.safetensors) or EAGLE-3 draft layer this directory holds")),
    (("--speculative-layers",), "SPECULATIVE_LAYERS",
     dict(default=0, type=_speculative_layers, help="draft the --speculate tokens with the model's own first K "
                                                   "layers, final norm and LM head (layer skip) instead of n-grams")),
    (("--waiting-served-ratio",), "WAITING_SERVED_RATIO", dict(default=0.3, type=float, help="as in TGI")),
    (("--max-new-tokens-default",), "MAX_NEW_TOKENS_DEFAULT",
     dict(default=1024, type=int, help="tokens generated when a request sets no limit (max_new_tokens, max_tokens, "
                                       "max_completion_tokens), cut to the room the prompt leaves; 0 = all that "
                                       "room, TGI's behaviour. /v1/completions keeps OpenAI's default of 16")),
    (("--reasoning-parser",), "REASONING_PARSER",
     dict(default="auto", choices=("auto", "qwen3", "deepseek_r1", "gpt_oss", "none"),
          help="split the reasoning (<think>...</think>, or gpt-oss harmony's analysis channel) from the answer: "
               "reasoning_content, thinking blocks, reasoning items; auto reads the chat template")),
    (("--tool-call-parser",), "TOOL_CALL_PARSER",
     dict(default="auto", choices=("auto", "hermes", "mistral", "llama3", "deepseek_v3", "deepseek_r1", "harmony",
                                   "json"),
          help="how the model writes tool calls (hermes: Hermes/Qwen <tool_call>, mistral: [TOOL_CALLS], llama3: "
               "Llama 3.x JSON, deepseek_v3: DeepSeek-V3.1 <｜tool▁call▁begin｜>, deepseek_r1: DeepSeek-R1's "
               "function<｜tool▁sep｜>NAME ```json calls, harmony: gpt-oss messages to functions.NAME, json: tools "
               "described in the prompt); auto reads the chat template")),
    (("--prefix-caching",), "PREFIX_CACHING",
     dict(default=True, type=_bool, help="share the KV blocks of equal prompt prefixes between requests "
                                         "(true|false); the hits show as usage.prompt_tokens_details.cached_tokens")),
    (("--cuda-memory-fraction",), "CUDA_MEMORY_FRACTION",
     dict(default=1.0, type=float, help="share of the GPU this process may use; on CPU, its share of the memory the "
                                         "KV cache is sized from (engines sharing a node)")),
    (("--kv-cache-bytes",), "KV_CACHE_BYTES", dict(type=_size, help="KV-cache budget on CPU, e.g. 512MiB (default: half the memory available to the job, from its cgroup, Slurm or the machine)")),
    (("--cuda-graphs",), "CUDA_GRAPHS", dict(type=_batch_sizes, help="decode batch sizes captured as CUDA graphs, "
                                             "e.g. 1,2,4,8; 0 = none (default: 1,2,4,...,256 on one GPU "
                                             "with the triton or flash-attn attention backend)")),
    (("--piecewise-graphs",), "PIECEWISE_GRAPHS",
     dict(type=_batch_sizes, help="step token counts whose forward is captured as CUDA graphs cut at attention, "
                                  "for prefill, mixed and drafted steps, e.g. 16,64,256; 0 = none (default on a GPU: "
                                  "1,2,4,8, every 16 to 256, every 32 to 512; off CUDA an explicit "
                                  "list runs the same split forward uncaptured, for tests)")),
    (("--async-scheduling",), "ASYNC_SCHEDULING",
     dict(default="auto", choices=["auto", "on", "off"],
          help="launch step N+1 before step N's tokens reach the host, which does N's work "
               "while the device runs N+1 (auto: on with CUDA, on one node; on a CPU nothing overlaps)")),
    (("--attention-backend",), "ATTENTION_BACKEND",
     dict(default="auto", choices=ATTENTION_CHOICES,
          help="paged attention: auto = the first of flash-attn, triton (CUDA), cpu_paged (CPU) and portable "
               "(any device) that passes its start-up check against the reference; naming one fails if it "
               "cannot run")),
    (("--model-impl",), "MODEL_IMPL",
     dict(default="auto", choices=("auto", "native", "transformers"),
          help="native = our model classes, transformers = any causal LM transformers builds, on our paged "
               "attention; auto = native when there is a class for the architecture, else transformers")),
    (("--block-size",), "BLOCK_SIZE", dict(type=_block_size, help="tokens per paged-KV block, a power of two "
                                           "(default: the attention backend's: 256 for flash-attn, else 16)")),
    (("--cpu-threads",), "CPU_THREADS",
     dict(type=int, help="torch threads of the model on CPU (default: OMP_NUM_THREADS when set, else every core "
                         "of the allocation); on a machine shared with other busy processes, leave one or more "
                         "cores free")),
    (("--cpu-gemm",), "CPU_GEMM", dict(default="auto", choices=["auto", "onednn", "aten"],
                                       help="linear layers on CPU: oneDNN with weights reordered at load, or "
                                            "torch's F.linear; auto = oneDNN when it passes a self-check")),
    (("--enforce-eager",), "ENFORCE_EAGER",
     dict(default=False, type=_bool, nargs="?", const=True,
          help="run every step module by module: no decode CUDA graphs on GPU, no fused decode step on CPU "
               "(engine/cpu_decode_step.py); for debugging and comparisons")),
    (("--cpu-elementwise",), "CPU_ELEMENTWISE",
     dict(default="auto", choices=["auto", "fused", "aten"],
          help="RMSNorm (+ residual), RoPE and SiLU-and-mul on CPU in float32: one-pass C++ kernels, or torch's "
               "ops; auto = fused when g++ builds them and they pass a self-check")),
    (("--gpu-elementwise",), "GPU_ELEMENTWISE",
     dict(default="auto", choices=["auto", "triton", "aten"],
          help="RMSNorm (+ residual), RoPE and SiLU-and-mul on CUDA: one Triton kernel each, or torch's ops; "
               "auto = triton when they pass a self-check")),
    (("--drain-timeout",), "DRAIN_TIMEOUT",
     dict(default=25.0, type=float, help="seconds requests in flight get to finish after SIGTERM (new connections "
                                         "are refused, /health answers 503 draining); keep it below Slurm's "
                                         "KillWait (30 s by default), after which Slurm kills the job")),
    (("--max-images-per-request",), "MAX_IMAGES_PER_REQUEST",
     dict(default=8, type=int, help="images one request may carry to a vision-language model (more: 422)")),
    (("--max-image-bytes",), "MAX_IMAGE_BYTES",
     dict(default=20 * 2**20, type=_size, help="largest image, encoded (data: URL or http(s) body), e.g. 20MiB")),
    (("--image-fetch-timeout",), "IMAGE_FETCH_TIMEOUT",
     dict(default=10.0, type=float, help="seconds to fetch one http(s) image; a slower or unreachable one is a 422")),
    (("--image-fetch",), "IMAGE_FETCH",
     dict(default="allow", choices=["allow", "deny"],
          help="http(s) image URLs: allow = the server fetches any URL it can reach, cluster-internal addresses "
               "included (as TGI does); deny = a 422 (data: URLs always work)")),
    (("--max-client-batch-size",), "MAX_CLIENT_BATCH_SIZE",
     dict(default=2048, type=int, help="inputs per request to a pooling model (/v1/embeddings, /embed, rerank, "
                                       "score), as TEI's flag")),
]


def build_parser(environ: dict[str, str] | None = None) -> argparse.ArgumentParser:
    env = os.environ if environ is None else environ
    parser = _Parser(prog="python -m engine",
                     description="Serve one model with a TGI- and OpenAI-compatible HTTP API. Every flag can also "
                                 "be set through the environment variable shown in its help.")
    env_vars: dict[str, str] = {}
    for flags, var, kw in _FLAGS:
        default = kw.get("default")
        shown = f" (default: {default})" if default is not None else ""
        options = {**kw, "help": f"{kw['help']} [env: {var}]{shown}"}
        if env.get(var) is not None:
            options["default"] = env[var]  # a string: argparse runs it through `type` like a flag value
        parser.add_argument(*flags, **options)
        env_vars[flags[0].lstrip("-").replace("-", "_")] = var
    parser.add_argument("--cors-allow-origin", action="append",
                        help="allowed CORS origin; repeat the flag [env: CORS_ALLOW_ORIGIN, comma-separated]")
    if env.get("MAX_INPUT_LENGTH") and not env.get("MAX_INPUT_TOKENS"):
        parser.set_defaults(max_input_tokens=env["MAX_INPUT_LENGTH"])
    parser.set_defaults(_env_vars=env_vars)
    return parser


def parse_args(argv: list[str] | None = None, environ: dict[str, str] | None = None) -> argparse.Namespace:
    env = os.environ if environ is None else environ
    parser = build_parser(env)
    args = parser.parse_args(argv)
    for action in parser._actions:  # argparse skips `choices` for defaults, which is where env values land
        value = getattr(args, action.dest, None)
        if action.choices and value is not None and value not in action.choices:
            var = args._env_vars.get(action.dest, action.dest)
            parser.error(f"{var}={value!r} is not one of {', '.join(map(str, action.choices))}")
    if args.model_id is None:
        parser.error("--model-id is required (or set MODEL_ID)")
    if int(args.max_new_tokens_default) < 0:
        parser.error(f"--max-new-tokens-default must be >= 0 (0 = all the room left), got {args.max_new_tokens_default}")
    if args.cpu_threads is not None and int(args.cpu_threads) < 1:
        parser.error(f"--cpu-threads must be >= 1, got {args.cpu_threads}")
    if args.quantize not in (None, "", "none"):
        from engine.layers.quantization.config import SUPPORTED, SUPPORTED_LINE  # imports torch: only when asked

        if args.quantize not in SUPPORTED:
            parser.error(f"--quantize {args.quantize} is not supported; {SUPPORTED_LINE}")
    if isinstance(args.max_input_tokens, str):  # MAX_INPUT_LENGTH went in as a raw default
        args.max_input_tokens = int(args.max_input_tokens)
    if args.cors_allow_origin is None and env.get("CORS_ALLOW_ORIGIN"):
        args.cors_allow_origin = [o.strip() for o in env["CORS_ALLOW_ORIGIN"].split(",") if o.strip()]
    return args


def to_config(args: argparse.Namespace, model_dir: str) -> EngineConfig:
    config = EngineConfig(
        model_id=model_dir, revision=args.revision, dtype=args.dtype, load_format=args.load_format,
        quantize=args.quantize if args.quantize not in (None, "", "none") else None,
        trust_remote_code=args.trust_remote_code, lora_adapters=list(args.lora_adapters or []),
        enable_runtime_lora=args.enable_runtime_lora, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
        num_shard=args.num_shard, pipeline_parallel_size=args.pipeline_parallel_size,
        rank_timeout_s=args.rank_timeout, step_timeout_s=args.step_timeout, master_addr=args.master_addr,
        master_port=args.master_port, device=args.device, max_concurrent_requests=args.max_concurrent_requests,
        max_best_of=args.max_best_of, max_stop_sequences=args.max_stop_sequences,
        max_top_n_tokens=args.max_top_n_tokens, max_input_tokens=args.max_input_tokens,
        max_total_tokens=args.max_total_tokens, max_batch_prefill_tokens=args.max_batch_prefill_tokens,
        max_batch_total_tokens=args.max_batch_total_tokens, max_batch_size=args.max_batch_size,
        waiting_served_ratio=args.waiting_served_ratio, max_new_tokens_default=args.max_new_tokens_default,
        prefix_caching=args.prefix_caching, cuda_memory_fraction=args.cuda_memory_fraction,
        hostname=args.hostname, port=args.port, api_key=args.api_key or None,
        cors_allow_origin=list(args.cors_allow_origin or []), json_output=args.json_output,
        served_model_name=args.served_model_name or args.model_id, cpu_gemm=args.cpu_gemm, cpu_elementwise=args.cpu_elementwise,
        gpu_elementwise=args.gpu_elementwise,
        cuda_graphs=args.cuda_graphs, piecewise_graphs=args.piecewise_graphs,
        async_scheduling=args.async_scheduling,
        attention_backend=args.attention_backend, block_size=args.block_size,
        speculate=AUTO_MAX_DRAFTS if args.speculate == "auto" else args.speculate,
        speculate_auto=args.speculate == "auto", speculative_layers=args.speculative_layers,
        speculative_model=args.speculative_model or None,
        max_grammar_bytes=args.max_grammar_bytes, grammar_timeout_s=args.grammar_timeout,
        reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser,
        model_impl=args.model_impl, enforce_eager=bool(args.enforce_eager))
    if args.kv_cache_bytes is not None:
        config.cpu_kv_cache_bytes = args.kv_cache_bytes
    config.max_client_batch_size = int(args.max_client_batch_size)
    config.max_images_per_request = args.max_images_per_request
    config.max_image_bytes = args.max_image_bytes
    config.image_fetch_timeout_s = args.image_fetch_timeout
    config.image_fetch = args.image_fetch
    return config


def resolve_model_dir(model_id: str, revision: str | None) -> str:
    """A local directory as is; a Hub id from the local HF cache only (compute nodes are offline)."""
    if Path(model_id).is_dir():
        return str(Path(model_id).resolve())
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(model_id, revision=revision, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure means "not available here"
        raise SystemExit(f"error: --model-id {model_id!r} is neither a directory nor in the local Hugging Face "
                         f"cache ({type(exc).__name__}); download it first on a node with internet, e.g. "
                         f"`hf download {model_id}`, or pass the snapshot directory") from None


def resolve_adapter_dir(path: str) -> str:
    """A LoRA adapter directory as is; a Hub id from the local HF cache when it is there (else left for the
    adapter check to refuse with its own message)."""
    if Path(path).is_dir() or path.count("/") != 1 or path.startswith((".", "/")):
        return path
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(path, local_files_only=True)
    except Exception:  # noqa: BLE001 - not cached: the adapter check says so
        return path


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {"timestamp": self.formatTime(record), "level": record.levelname, "target": record.name,
                 "message": record.getMessage()}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(json_output: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter() if json_output else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)


def bind_socket(host: str, port: int, attempts: int = 1) -> socket.socket:
    """`port`, or the next free one of `attempts`: the bind itself is the check, so no other process can take
    the port between a check and the bind (the caller reads the bound port back from the socket)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    last = min(port + max(1, attempts) - 1, 65535) if port else 0
    for candidate in range(port, last + 1):
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, candidate))
            sock.listen(2048)   # bound but not listening, another SO_REUSEADDR socket could still bind it
        except OSError as exc:
            sock.close()
            error = exc
            continue
        if candidate != port:
            logger.warning("port %d on %s is taken: listening on %d instead", port, host, candidate)
        sock.set_inheritable(True)
        return sock
    ports = f"{port}" if last == port else f"{port}..{last}"
    raise SystemExit(f"error: cannot listen on {host}:{ports}: {error.strerror}; pick another --port "
                     "(0 = any free port)") from None


def write_ready_file(path: str, payload: dict[str, Any]) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(payload, f)
    os.replace(tmp, target)  # readers never see a half-written file


# after the engine dies, the process ends within this many seconds even if the model thread is stuck in a collective
EXIT_GRACE_S = 8.0


def _runner_failure(engine: Any) -> str | None:
    """Why the model runner cannot run any more (a rank dead, silent or hung), or None."""
    runner = getattr(engine.engine, "runner", None)
    if getattr(runner, "failure", None):
        return runner.failure
    dead = runner.dead_workers() if hasattr(runner, "dead_workers") else []
    return f"worker process(es) {dead} died" if dead else None


def _exit_soon(reason: str) -> None:
    """Exit with status 1 in EXIT_GRACE_S, whatever the model thread is doing (it may wait on a dead peer)."""
    timer = threading.Timer(EXIT_GRACE_S, _exit_now, args=(1, reason))
    timer.daemon = True
    timer.start()


def _exit_now(status: int, reason: str) -> None:
    logger.error("exiting with status %d: %s", status, reason)
    exit_without_teardown(status)


def exit_without_teardown(status: int) -> None:
    """Flush the logs and end the process. A normal interpreter exit first tears down torch.distributed, whose
    process groups and store may wait on a peer that is dead or stopped (issue 27: a rank 0 whose peer was
    killed still ran after 60 s), and no daemon thread can run during that teardown to end it."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


async def _exit_when_engine_dies(server: Any, engine: Any) -> None:
    """A dead engine or tensor-parallel rank ends the server: the job must fail, not idle at 503. Requests in
    flight get the error now; the process ends within EXIT_GRACE_S even if the model thread never returns."""
    while not server.should_exit:
        failure = _runner_failure(engine)
        if engine.error is not None or failure:
            reason = engine.error or failure
            logger.error("the engine died (%s): shutting down", reason)
            engine.fail(engine.error or RuntimeError(str(reason)))
            server.should_exit = True
            _exit_soon(f"the engine died ({reason})")
            return
        await asyncio.sleep(0.5)


async def _serve(server: Any, sock: socket.socket, ready_file: str | None, engine: Any, drain: Any) -> None:
    from engine.server.drain import drain_when_asked

    task = asyncio.create_task(server.serve(sockets=[sock]))
    watchdog = asyncio.create_task(_exit_when_engine_dies(server, engine))
    draining = asyncio.create_task(drain_when_asked(server, drain))
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        host, port = sock.getsockname()[:2]
        logger.info("serving on http://%s:%d", host, port)
        if ready_file:
            write_ready_file(ready_file, {"host": host, "port": port, "pid": os.getpid()})
    await task
    watchdog.cancel()
    draining.cancel()


def build_engine(config: EngineConfig, layout: Any = None) -> Any:
    """The engine this snapshot needs: an embedder or cross-encoder, an encoder-decoder, or LLMEngine (over srun or
    torchrun ranks when `layout` says there are some). The server and the offline batch both start theirs here."""
    from engine.llm_engine import LLMEngine

    return _pooling_engine(config, layout) or _seq2seq_engine(config, layout) or (
        LLMEngine(config) if layout is None else _driven_engine(config, layout))


def _pooling_engine(config: EngineConfig, layout: Any) -> Any:
    """An embedder or cross-encoder (engine/pooling/) instead of LLMEngine, when the snapshot is one."""
    from engine.pooling.spec import detect

    spec = detect(config.model_id)
    if spec is None:
        return None
    if layout is not None or config.num_shard > 1 or config.lora_adapters or config.quantize:
        raise ValueError("pooling models run on one device without --num-shard, pipeline ranks, LoRA or --quantize")
    import torch

    from engine.pooling.engine import PoolingEngine
    from engine.worker import resolve_device
    cpu = resolve_device(config.device, 0).type == "cpu"  # one single-threaded forward per CPU thread
    return PoolingEngine(config, spec, workers=torch.get_num_threads() if cpu else 1)


def _seq2seq_engine(config: EngineConfig, layout: Any) -> Any:
    """An encoder-decoder (engine/seq2seq/: flan-t5) instead of LLMEngine, when config.json says it is one."""
    from engine.seq2seq.engine import Seq2SeqEngine, is_seq2seq

    if not is_seq2seq(config.model_id):
        return None
    if layout is not None:
        raise ValueError("encoder-decoder models run on one device: no srun/torchrun ranks")
    return Seq2SeqEngine(config)


def _driven_engine(config: EngineConfig, layout: Any) -> Any:
    """Rank 0 of srun/torchrun-started ranks: the engine over a runner that drives all of them."""
    from engine.external_launch import DistributedRunner
    from engine.llm_engine import LLMEngine
    from engine.model_config import ModelConfig

    model_config = ModelConfig.from_pretrained(config.model_id, config.model_impl)
    logger.info("rank 0 of %d (%d pipeline stage(s) x %d shard(s)); rendezvous at %s:%d", layout.world_size,
                layout.pp_size, layout.tp_size, config.master_addr, config.master_port)
    return LLMEngine(config, runner=DistributedRunner(config, model_config, layout), model_config=model_config)


def _follow(config: EngineConfig, layout: Any, cpu_threads: int | None) -> int:
    """Ranks 1..N-1: no HTTP, no port, no endpoint; they run the steps rank 0 broadcasts."""
    import torch

    from engine.external_launch import follower_main
    from engine.model_config import ModelConfig
    if cpu_threads is not None:
        torch.set_num_threads(cpu_threads)
    logging.getLogger().setLevel(logging.WARNING)  # rank 0 logs for the job
    logging.getLogger("engine.external_launch").setLevel(logging.INFO)
    return follower_main(config, ModelConfig.from_pretrained(config.model_id, config.model_impl), layout)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args.json_output)
    if argv is None and any(a == "--api-key" or a.startswith("--api-key=") for a in sys.argv[1:]):
        logger.warning("--api-key on the command line is visible to other users (ps); set API_KEY instead")
    config = to_config(args, resolve_model_dir(args.model_id, args.revision))
    config.lora_adapters = [(name, resolve_adapter_dir(path)) for name, path in config.lora_adapters]
    from engine import parallel_layout
    try:  # ranks started by srun or torchrun: only rank 0 serves HTTP
        layout = parallel_layout.from_env(os.environ, config.num_shard, config.pipeline_parallel_size)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    if layout is not None and layout.rank != 0:
        return _follow(config, layout, args.cpu_threads)
    logger.info("config: %r; API key %s", config, "required" if config.api_key else "not set")
    sock = bind_socket(config.hostname, config.port, args.port_attempts)  # fail fast, before minutes of loading
    config.port = sock.getsockname()[1]

    import uvicorn

    from engine.async_engine import AsyncEngine
    from engine.server.app import build_app
    from engine.server.drain import Drain, DrainMiddleware
    from engine.worker import available_cpus, resolve_device
    if resolve_device(config.device, 0).type == "cpu" and config.num_shard == 1:  # TP ranks split the cores
        # Every core by default: a Slurm job's cores are its own (cgroups), and on the idle 2-core VM two
        # threads decode 1.4x faster than one (docs/benchmarks.md). Where other busy processes share the
        # cores, an OpenMP team on all of them stalls at every barrier: --cpu-threads leaves some free.
        import torch
        if args.cpu_threads is not None:
            torch.set_num_threads(args.cpu_threads)
        logger.info("CPU: the model uses %d torch threads on %d cores", torch.get_num_threads(), available_cpus())
    try:
        llm = build_engine(config, layout)
    except (ValueError, FileNotFoundError) as exc:
        logger.error("cannot start the engine: %s", exc)
        return 1
    # The model runs in the main thread (faster CPU kernels, see AsyncEngine.run_here); HTTP in a thread.
    engine = AsyncEngine(llm)
    drain = Drain(args.drain_timeout)
    try:
        app = DrainMiddleware(build_app(engine, config), drain)
    except ValueError as exc:  # the model's processor cannot load (engine/multimodal/processor.py)
        logger.error("cannot start the engine: %s", exc)
        engine.close()
        return 1
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, lifespan="off", timeout_graceful_shutdown=5))
    http = threading.Thread(target=lambda: asyncio.run(_serve(server, sock, args.ready_file, engine, drain)),
                            name="http", daemon=True)

    def stop(signum: int, frame: Any) -> None:
        if drain.draining:  # a second signal: stop now
            server.should_exit = True
        drain.begin()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    gc_tuning.apply()   # everything start-up made is alive now: frozen; young collections rarer
    http.start()
    try:
        engine.run_here(keep_running=http.is_alive)
    finally:
        server.should_exit = True
        if engine.error is not None:
            _exit_soon(f"the engine died ({engine.error}); its shutdown took too long")
        http.join(10)
        engine.close()
    if engine.error is not None:
        _exit_now(1, f"the engine died ({engine.error})")
    return 0
