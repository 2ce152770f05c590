"""In-process engine benchmark: a TGI-benchmark-style latency table, CPU overhead per step, HF baseline.

    python scripts/bench_engine.py --model-id smollm2                     # CPU, fp32, SmolLM2-135M
    python scripts/bench_engine.py --config-like 8b --load-format dummy \\
        --device cuda --dtype bfloat16 --batch-sizes 1,8,32,64,128,256 \\
        --prompt-len 128 --new-tokens 128 --hf-prompts 256 --hf-serial-max 4   # GPU, Llama-3.1-8B shape

(a) For each batch size B: B prompts of --prompt-len tokens are added at once, so step 1 is one
    prefill of B*L tokens and steps 2..N are pure decode steps of batch B. Prefill latency is the
    first step; decode latency is each later step (per-token latency of every sequence).
    CPU overhead = step() time minus the runner's forward time: `engine.runner.run` is wrapped with
    a timer (after a cuda synchronize, so GPU work of the forward is inside the runner's time), and
    `engine.worker.prepare_inputs` (building input tensors, part of the runner) is timed apart.
    What is left is the scheduler, the sampler (logits -> ids, incl. its device->host copy),
    detokenization and output building: what the scheduler+sampler target measures.
(h) --host-overhead: no model at all; host CPU time per decode step by phase at batch 256, 2k-token contexts
    and a 128k vocabulary, with a runner that returns logits at once (scripts/host_overhead.py).
(c) The same prompts through the engine (`LLMEngine.generate`) and through HF transformers
    `generate` as one padded batch and one request at a time; aggregate tok/s and ratios.
On CUDA it also measures memory-copy bandwidth and compares batch-1 decode ms/token with
weight bytes / bandwidth (the memory-bound floor).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `engine` importable from a checkout

# Llama-3.1-8B's config.json shape (weights are random: --load-format dummy)
LLAMA_3_1_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16",
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
}
CONFIGS_LIKE = {"8b": LLAMA_3_1_8B}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
# prompt material: varied text so prompts differ (a prefix cache must not make them free)
CORPUS = (
    "The history of computing is a story of people trying to make machines do arithmetic faster than they "
    "could by hand. Early mechanical calculators used gears and levers; later machines used relays, vacuum "
    "tubes and finally transistors. Each step made computers smaller, cheaper and more reliable. Today a "
    "cluster of graphics processors can train a language model on trillions of words, and a scheduler such as "
    "Slurm decides which job runs on which node. Researchers write batch scripts that request GPUs, memory and "
    "time, then wait in a queue until the resources are free. Inference servers keep a model in memory and "
    "answer many requests at once by batching them, because reading the weights from memory costs the same for "
    "one sequence as for many. Rivers carve valleys over millions of years; glaciers leave lakes and moraines "
    "behind. A good recipe for bread needs flour, water, salt, yeast and patience. Chess engines search millions "
    "of positions per second, while a human master looks at a handful of candidate moves."
)


# --- small helpers --------------------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); nan for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def resolve_device(name: str | None) -> torch.device:
    return torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))


def resolve_dtype(name: str | None, device: torch.device) -> str:
    return name or ("float32" if device.type == "cpu" else "bfloat16")


def torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]


def machine_info(device: torch.device) -> dict[str, Any]:
    """What the doc's results table needs to say about the box."""
    cpu = next((line.split(":", 1)[1].strip() for line in _read_lines("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    mem_kb = next((int(line.split()[1]) for line in _read_lines("/proc/meminfo") if line.startswith("MemTotal")), 0)
    info = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "nproc": os.cpu_count(), "cpu": cpu, "ram_gib": round(mem_kb / 2**20, 1),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "device": str(device),
            "python": platform.python_version()}
    with contextlib.suppress(ImportError):
        import transformers
        info["transformers"] = transformers.__version__
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["gpu_mem_gib"] = round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1)
    return info


def _read_lines(path: str) -> list[str]:
    try:
        return Path(path).read_text().splitlines()
    except OSError:
        return []


def print_machine(info: dict[str, Any]) -> None:
    print("machine: " + ", ".join(f"{k}={v}" for k, v in info.items()))


# --- model directories ----------------------------------------------------------------------------

def resolve_model_dir(model_id: str) -> Path:
    """A snapshot directory as is; a test-model name (smollm2, tiny-llama, ...) via scripts/make_models.py."""
    if Path(model_id).is_dir():
        return Path(model_id).resolve()
    from make_models import MODEL_NAMES, ensure_model
    if model_id in MODEL_NAMES:
        return ensure_model(model_id)
    raise SystemExit(f"error: --model-id {model_id!r} is neither a directory nor a test model "
                     f"({', '.join(MODEL_NAMES)})")


def write_config_like(name: str, tokenizer_dir: Path, overrides: dict[str, Any]) -> Path:
    """A temporary snapshot with the config.json of `name` and the tokenizer of `tokenizer_dir`.

    Only useful with --load-format dummy: there are no weights. The tokenizer only has to turn
    prompts into ids; ids it does not know decode to empty text.
    """
    if name not in CONFIGS_LIKE:
        raise SystemExit(f"error: --config-like {name!r} is unknown; choose one of {', '.join(CONFIGS_LIKE)}")
    target = Path(tempfile.mkdtemp(prefix=f"bench-{name}-"))
    (target / "config.json").write_text(json.dumps({**CONFIGS_LIKE[name], **overrides}, indent=2))
    for file in TOKENIZER_FILES:
        if (tokenizer_dir / file).exists():
            shutil.copy(tokenizer_dir / file, target / file)
    return target


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """key=value pairs (JSON values) that patch a --config-like config, e.g. num_hidden_layers=2."""
    overrides = {}
    for item in items:
        key, _, value = item.partition("=")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    return overrides


def prepare_model_dir(args: argparse.Namespace, device: torch.device) -> tuple[Path, bool]:
    """(snapshot dir, is a temporary dir to delete) from --model-id / --config-like."""
    if not args.config_like:
        return resolve_model_dir(args.model_id), False
    if args.load_format != "dummy":
        raise SystemExit("error: --config-like has no weights; add --load-format dummy")
    if device.type != "cuda" and not args.config_override:
        raise SystemExit(f"error: --config-like {args.config_like} is meant for a GPU (device is {device}); "
                         "shrink it with --config-override to try it on CPU")
    tokenizer_dir = resolve_model_dir(args.model_id)
    return write_config_like(args.config_like, tokenizer_dir, parse_overrides(args.config_override)), True


def make_prompts(tokenizer: Any, num: int, length: int, vocab_size: int) -> list[list[int]]:
    """`num` different prompts of exactly `length` token ids: a numbered header ("[17] "), then a window into
    CORPUS at a shifted offset. The header keeps the first KV block of every prompt distinct: windows alone
    repeat past a few hundred prompts, and the prefix cache would then admit the repeats a step later."""
    ids = [i for i in tokenizer.encode(CORPUS, add_special_tokens=False) if i < vocab_size]
    while len(ids) < length + num:
        ids = ids + ids
    prompts = []
    for i in range(num):
        head = [t for t in tokenizer.encode(f"[{i}] ", add_special_tokens=False) if t < vocab_size][:length // 2]
        prompts.append(head + ids[(i * 7) % (len(ids) - length):][:length - len(head)])
    return prompts


# --- the engine -----------------------------------------------------------------------------------

def build_engine(model_dir: Path, args: argparse.Namespace, device: torch.device, dtype: str,
                 max_batch: int, max_prompts: int, enforce_eager: bool = False) -> Any:
    """An LLMEngine whose prefill budget takes the largest batch in one step and whose KV cache holds it."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    most = max(max_batch, max_prompts)
    total_tokens = most * (args.prompt_len + args.new_tokens)
    config = EngineConfig(model_id=str(model_dir), dtype=dtype, load_format=args.load_format,
                          device=device.type, max_batch_prefill_tokens=most * args.prompt_len,
                          max_total_tokens=args.prompt_len + args.new_tokens + 16, max_batch_size=most,
                          cpu_gemm=args.cpu_gemm, gpu_elementwise=args.gpu_elementwise, cuda_graphs=args.cuda_graphs,
                          enforce_eager=enforce_eager, async_scheduling=args.async_scheduling)
    if device.type == "cpu":
        config.cpu_kv_cache_bytes = max(config.cpu_kv_cache_bytes or 0, int(kv_bytes_per_token(model_dir, dtype)
                                                                       * (total_tokens + 64 * most) * 1.1))
    return LLMEngine(config)


def kv_bytes_per_token(model_dir: Path, dtype: str) -> int:
    from engine.model_config import ModelConfig
    cfg = ModelConfig.from_pretrained(model_dir)
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * torch_dtype(dtype).itemsize


class ForwardTimer:
    """Times `engine.runner.run` (the model forward, synchronized) and `prepare_inputs` inside it.

    Wrapping the bound method on the runner instance leaves the engine's code untouched; the
    cuda synchronize moves the forward's GPU time out of the sampler's first device->host copy,
    where it would otherwise land.
    """

    def __init__(self, engine: Any, device: torch.device) -> None:
        import engine.worker as worker_module
        self.runner_s = 0.0
        self.prepare_s = 0.0
        self._device = device
        self._engine = engine
        self._worker = worker_module
        self._run, self._prepare = engine.runner.run, worker_module.prepare_inputs
        engine.runner.run = self._timed_run
        worker_module.prepare_inputs = self._timed_prepare

    def _timed_run(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        result = self._run(*args, **kwargs)
        synchronize(self._device)
        self.runner_s += time.perf_counter() - start
        return result

    def _timed_prepare(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        result = self._prepare(*args, **kwargs)
        self.prepare_s += time.perf_counter() - start
        return result

    def reset(self) -> None:
        self.runner_s = self.prepare_s = 0.0

    def restore(self) -> None:
        self._engine.runner.run = self._run
        self._worker.prepare_inputs = self._prepare


def greedy(new_tokens: int) -> Any:
    from engine.sampling_params import SamplingParams
    return SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, logprobs=False)


def run_batch(engine: Any, timer: ForwardTimer, prompts: list[list[int]], new_tokens: int,
              device: torch.device, tag: str) -> dict[str, Any]:
    """One TGI-benchmark run: B prompts in, prefill step, then decode steps until all finish."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, greedy(new_tokens))
    steps: list[dict[str, float]] = []
    while engine.has_unfinished_requests():
        timer.reset()
        synchronize(device)
        start = time.perf_counter()
        engine.step()
        total = time.perf_counter() - start
        steps.append({"total": total, "runner": timer.runner_s, "prepare": timer.prepare_s,
                      "batch": engine.stats().batch_size})
    prefill, decodes = steps[0], steps[1:]
    if prefill["batch"] != len(prompts) or any(s["batch"] != len(prompts) for s in decodes):
        print(f"  note: batch {len(prompts)} was not run as one prefill + full decode steps "
              f"(step batch sizes {[s['batch'] for s in steps]})", file=sys.stderr)
    return {"prefill": prefill, "decode": decodes}


def generate_seconds(engine: Any, prompts: list[list[int]], new_tokens: int, device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    engine.generate(prompts, greedy(new_tokens))
    synchronize(device)
    return time.perf_counter() - start


def streamed_decode(engine: Any, args: argparse.Namespace, device: torch.device,
                    prompts: list[list[int]]) -> list[dict[str, Any]]:
    """Decode ms per step as a caller sees it: B prompts through `generate` with N new tokens, then with 1, no
    synchronize between steps (so async scheduling's overlap counts, which table (a)'s per-step timing removes):
    (t(N) - t(1)) / (N - 1), the median over --runs pairs."""
    rows = []
    for batch_size in args.batch_sizes:
        batch = prompts[:batch_size]
        generate_seconds(engine, batch, 1, device)     # the prompts cached once, as every timed run finds them
        per_step = []
        for _ in range(args.runs):
            full = generate_seconds(engine, batch, args.new_tokens, device)
            prefill = generate_seconds(engine, batch, 1, device)
            per_step.append((full - prefill) / (args.new_tokens - 1) * 1e3)
        ms = statistics.median(per_step)
        rows.append({"batch": batch_size, "runs": args.runs, "decode_ms": ms, "decode_tok_s": batch_size / ms * 1e3,
                     "decode_ms_runs": per_step})
        print(f"| {batch_size} | {ms:.2f} | {batch_size / ms * 1e3:.0f} | "
              f"{' / '.join(f'{v:.2f}' for v in per_step)} |", flush=True)
    return rows


def bench_table(engine: Any, args: argparse.Namespace, device: torch.device,
                prompts: list[list[int]]) -> list[dict[str, Any]]:
    timer = ForwardTimer(engine, device)
    try:
        run_batch(engine, timer, prompts[:2], 4, device, "warmup")
        rows = []
        for batch_size in args.batch_sizes:
            runs = [run_batch(engine, timer, prompts[:batch_size], args.new_tokens, device, f"b{batch_size}-r{r}")
                    for r in range(args.runs)]
            rows.append(summarize(batch_size, args.prompt_len, runs))
            print_row(rows[-1], header=len(rows) == 1)
        return rows
    finally:
        timer.restore()


def summarize(batch_size: int, prompt_len: int, runs: list[dict[str, Any]]) -> dict[str, Any]:
    prefill = [r["prefill"]["total"] * 1e3 for r in runs]
    steps = [s for r in runs for s in r["decode"]]
    decode = [s["total"] * 1e3 for s in steps]
    overhead = [(s["total"] - s["runner"]) * 1e3 for s in steps]
    prepare = [s["prepare"] * 1e3 for s in steps]
    forward = [(s["runner"] - s["prepare"]) * 1e3 for s in steps]
    p50 = lambda v: percentile(v, 50)  # noqa: E731
    return {
        "batch": batch_size, "runs": len(runs), "decode_steps": len(steps),
        "prefill_ms_p50": p50(prefill), "prefill_ms_p90": percentile(prefill, 90),
        "prefill_tok_s": batch_size * prompt_len / (p50(prefill) / 1e3),
        "decode_ms_p50": p50(decode), "decode_ms_p90": percentile(decode, 90),
        "decode_tok_s": batch_size / (p50(decode) / 1e3),
        "cpu_overhead_ms_p50": p50(overhead), "cpu_overhead_ms_p90": percentile(overhead, 90),
        "prepare_ms_p50": p50(prepare), "forward_ms_p50": p50(forward),
    }


COLUMNS = [("batch", "B", "{:d}"), ("prefill_ms_p50", "prefill p50 ms", "{:.1f}"),
           ("prefill_ms_p90", "prefill p90 ms", "{:.1f}"), ("prefill_tok_s", "prefill tok/s", "{:.0f}"),
           ("decode_ms_p50", "decode p50 ms/tok", "{:.2f}"), ("decode_ms_p90", "decode p90 ms/tok", "{:.2f}"),
           ("decode_tok_s", "decode tok/s", "{:.0f}"), ("cpu_overhead_ms_p50", "sched+sampler p50 ms", "{:.3f}"),
           ("cpu_overhead_ms_p90", "sched+sampler p90 ms", "{:.3f}"), ("prepare_ms_p50", "prepare_inputs ms",
                                                                       "{:.3f}"),
           ("forward_ms_p50", "forward ms", "{:.2f}")]


def print_row(row: dict[str, Any], header: bool) -> None:
    if header:
        print("| " + " | ".join(title for _, title, _ in COLUMNS) + " |")
        print("|" + "---|" * len(COLUMNS))
    print("| " + " | ".join(fmt.format(row[key]) for key, _, fmt in COLUMNS) + " |", flush=True)


def engine_throughput(engine: Any, prompts: list[list[int]], new_tokens: int, device: torch.device) -> dict:
    """All prompts at once through LLMEngine.generate (continuous batching); aggregate generated tok/s."""
    engine.generate(prompts[:1], greedy(2))  # warm-up, as the HF baseline gets
    synchronize(device)
    start, cpu_start = time.perf_counter(), time.process_time()
    outputs = engine.generate(prompts, greedy(new_tokens))
    synchronize(device)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    tokens = sum(o.num_generated_tokens for o in outputs)
    return throughput(len(prompts), tokens, elapsed, cpu)


def throughput(requests: int, tokens: int, seconds: float, cpu_s: float | None) -> dict[str, Any]:
    """Wall-clock tok/s, plus CPU-seconds spent (all threads of the process): on a shared box the
    CPU time per token moves much less with other people's load than the wall time does."""
    return {"requests": requests, "tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
            "cpu_s": cpu_s, "tok_per_cpu_s": tokens / cpu_s if cpu_s else None}


# --- GPU memory bandwidth -------------------------------------------------------------------------

def copy_bandwidth(device: torch.device, num_bytes: int = 2 * 2**30, iters: int = 20) -> float:
    """Bytes/s of a large device-to-device copy, counting the read and the write."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    synchronize(device)
    elapsed = time.perf_counter() - start
    del src, dst
    torch.cuda.empty_cache()
    return 2 * num_bytes * iters / elapsed


def weight_bytes_per_token(model_dir: Path, dtype: str) -> int:
    """Bytes of weights a decode step must read: all parameters except an untied embedding table
    (decode gathers only B rows of it; a tied one is read in full as the LM head)."""
    from engine.model_config import ModelConfig
    cfg = ModelConfig.from_pretrained(model_dir)
    params = cfg.num_params
    if not cfg.tie_word_embeddings:
        params -= cfg.vocab_size * cfg.hidden_size
    return params * torch_dtype(dtype).itemsize


# --- HF transformers baseline ---------------------------------------------------------------------

def load_hf_model(model_dir: Path, dtype: str, device: torch.device, dummy: bool) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if dummy:
        config = AutoConfig.from_pretrained(model_dir)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype(dtype))
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype(dtype)).to(device)
    return model.eval()


def left_pad(prompts: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return ids, mask


@torch.inference_mode()
def hf_generate(model: Any, prompts: list[list[int]], new_tokens: int, batch_size: int, pad_id: int,
                device: torch.device) -> dict[str, Any]:
    """Greedy HF generate in padded batches of `batch_size`, exactly `new_tokens` tokens each (EOS ignored)."""
    synchronize(device)
    start, cpu_start = time.perf_counter(), time.process_time()
    tokens = 0
    for i in range(0, len(prompts), batch_size):
        ids, mask = left_pad(prompts[i:i + batch_size], pad_id, device)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_id)
        tokens += (out.shape[1] - ids.shape[1]) * ids.shape[0]
    synchronize(device)
    return throughput(len(prompts), tokens, time.perf_counter() - start, time.process_time() - cpu_start)


def hf_baselines(model_dir: Path, prompts: list[list[int]], new_tokens: int, dtype: str, device: torch.device,
                 dummy: bool, pad_id: int, serial_max: int) -> dict[str, Any]:
    """HF generate on the same prompts: one padded batch, and one at a time (the first `serial_max`)."""
    model = load_hf_model(model_dir, dtype, device, dummy)
    hf_generate(model, prompts[:1], 2, 1, pad_id, device)  # warm-up
    result = {"batch": hf_generate(model, prompts, new_tokens, len(prompts), pad_id, device)}
    if serial_max > 0:
        result["serial"] = hf_generate(model, prompts[:serial_max], new_tokens, 1, pad_id, device)
    del model
    free_memory(device)
    return result


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def print_throughput(label: str, result: dict[str, Any]) -> None:
    cpu = f"  ({result['cpu_s']:.1f} CPU-s, {result['tok_per_cpu_s']:.1f} tok/CPU-s)" if result.get("cpu_s") else ""
    print(f"{label:<34} {result['requests']:>4} req {result['tokens']:>6} tok {result['seconds']:8.2f} s "
          f"{result['tok_s']:9.1f} tok/s{cpu}", flush=True)


def print_ratios(engine_result: dict[str, Any], hf: dict[str, Any]) -> None:
    for kind, result in hf.items():
        cpu = (f", {engine_result['tok_per_cpu_s'] / result['tok_per_cpu_s']:.2f}x tok/CPU-s"
               if engine_result.get("tok_per_cpu_s") and result.get("tok_per_cpu_s") else "")
        print(f"ratio engine / HF {kind:<6}: {engine_result['tok_s'] / result['tok_s']:.2f}x tok/s{cpu}")


# --- main -----------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-id", default="smollm2", help="snapshot dir or test-model name (tokenizer source "
                        "with --config-like)")
    parser.add_argument("--load-format", default="safetensors", choices=["safetensors", "dummy"])
    parser.add_argument("--config-like", choices=sorted(CONFIGS_LIKE), help="random weights of this shape "
                        "(Llama-3.1-8B); needs --load-format dummy, meant for a GPU")
    parser.add_argument("--config-override", nargs="*", default=[], metavar="KEY=VALUE",
                        help="patch the --config-like config (e.g. num_hidden_layers=2 to try it on CPU)")
    parser.add_argument("--batch-sizes", default="1,2,4,8,16,32,64",
                        type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--prompt-len", type=int, default=32, help="tokens per prompt")
    parser.add_argument("--new-tokens", type=int, default=16, help="generated tokens per request (EOS ignored)")
    parser.add_argument("--runs", type=int, default=2, help="runs per batch size (TGI benchmark's n-runs)")
    parser.add_argument("--hf-prompts", type=int, default=16, help="prompts in the engine-vs-HF comparison")
    parser.add_argument("--hf-serial-max", type=int, default=4,
                        help="how many of them HF runs one at a time (0 = skip)")
    parser.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    parser.add_argument("--no-table", action="store_true", help="skip the latency table")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"],
                        help="default: float32 on CPU, bfloat16 on GPU")
    parser.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice, one per core)")
    parser.add_argument("--cpu-gemm", default="auto", choices=["auto", "onednn", "aten"],
                        help="the engine's linear layers on CPU (HF always uses torch's F.linear)")
    parser.add_argument("--gpu-elementwise", default="auto", choices=["auto", "triton", "aten"],
                        help="norm / RoPE / SiLU-and-mul on CUDA: fused Triton kernels or torch's ops (A/B)")
    parser.add_argument("--cuda-graphs", type=lambda s: [int(x) for x in s.split(",") if int(x) > 0],
                        help="decode batch sizes to capture (0 = none; default: the engine's)")
    parser.add_argument("--async-scheduling", default="auto", choices=["auto", "on", "off"],
                        help="engine/async_scheduling.py (auto: on with CUDA)")
    parser.add_argument("--json-out", help="also write every number to this JSON file")
    host = parser.add_argument_group("--host-overhead (scripts/host_overhead.py): no model, logits at once")
    host.add_argument("--host-overhead", action="store_true",
                      help="host CPU time per decode step by phase, with a stand-in runner")
    host.add_argument("--batch", type=int, default=256, help="sequences decoding together")
    host.add_argument("--context", type=int, default=2048, help="prompt tokens per sequence")
    host.add_argument("--vocab", type=int, default=128256, help="logits width")
    host.add_argument("--steps", type=int, default=30,
                      help="measured decode steps (three times: plain, phase-timed, detokenizer-timed)")
    host.add_argument("--warmup", type=int, default=5, help="decode steps before measuring")
    host.add_argument("--sampling", choices=["greedy", "mixed"], default="greedy",
                      help="greedy: TGI's default request; mixed: half the rows sample (seeded, "
                      "temperature, top-k, top-p, repetition penalty)")
    host.add_argument("--evict-mb", type=int, default=0,
                      help="also read this many MiB inside the full-width sample call (its time taken off with "
                      "that call's): at --vocab 4096, 125 evicts the caches as 128k logits do")
    host.add_argument("--eager-text", action="store_true",
                      help="decode every sequence's text in the step, as before deferred_text.py (the server's "
                      "event loop decodes it otherwise)")
    args = parser.parse_args(argv)
    if args.new_tokens < 2 and not args.no_table:
        parser.error("--new-tokens must be 2 or more: decode is timed from the second token on")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.host_overhead:
        import host_overhead
        # one torch thread unless told: on a shared box, idle OpenMP workers spinning inflate CPU time
        torch.set_num_threads(args.threads or 1)
        print_machine(machine_info(torch.device("cpu")))
        results = host_overhead.run(args)
        if args.json_out:
            Path(args.json_out).write_text(json.dumps({"args": vars(args), **results}, indent=2, default=str))
        return 0
    run_benchmark(args, run)
    return 0


def run_benchmark(args: argparse.Namespace, run: Any) -> dict[str, Any]:
    """What both bench scripts do around their `run(args, model_dir, device, dtype)`: threads, device and
    dtype, the machine header, the model folder (a temporary one is removed), and the JSON file."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    info = machine_info(device)
    print_machine(info)
    model_dir, temporary = prepare_model_dir(args, device)
    try:
        results = run(args, model_dir, device, dtype)
    finally:
        if temporary:
            shutil.rmtree(model_dir, ignore_errors=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"machine": info, "args": vars(args), **results}, indent=2,
                                                  default=str))
    return results


def run(args: argparse.Namespace, model_dir: Path, device: torch.device, dtype: str) -> dict[str, Any]:
    print(f"model: {args.config_like or model_dir} ({args.load_format}, {dtype}, {device}); prompt "
          f"{args.prompt_len} tokens, {args.new_tokens} new tokens, greedy, EOS ignored", flush=True)
    results: dict[str, Any] = {}
    if device.type == "cuda":
        results["bandwidth_gb_s"] = copy_bandwidth(device) / 1e9
        print(f"device-to-device copy bandwidth: {results['bandwidth_gb_s']:.0f} GB/s (read + write)")
    max_batch = max(args.batch_sizes) if not args.no_table else 1
    engine = build_engine(model_dir, args, device, dtype, max_batch, args.hf_prompts)
    results["backends"] = {"attention": engine.runner.attention_backend, "linear": engine.runner.linear_backend,
                           "elementwise": engine.runner.elementwise_backend,
                           "cuda_graphs": engine.runner.cuda_graph_sizes}
    print(f"engine backends: attention {results['backends']['attention']}, linear {results['backends']['linear']}, "
          f"element-wise {results['backends']['elementwise']}, "
          f"decode CUDA graphs {results['backends']['cuda_graphs'] or 'none'}")
    try:
        pad_id = engine.tokenizer.pad_token_id or min(engine.eos_token_ids, default=0)
        prompts = make_prompts(engine.tokenizer, max(max_batch, args.hf_prompts), args.prompt_len,
                               engine.vocab_size)
        if not args.no_table:
            print(f"\n(a) latency per batch size ({args.runs} runs each; decode = one step = one token per "
                  "sequence; sched+sampler = step() minus runner.run)")
            results["table"] = bench_table(engine, args, device, prompts)
            print(f"\n(b) decode through generate, no synchronize per step (async scheduling "
                  f"{'on' if engine.schedules_ahead else 'off'}): (t({args.new_tokens} tokens) - t(1 token)) / {args.new_tokens - 1}")
            print("| B | decode ms/step (median) | decode tok/s | each run, ms |\n|---|---|---|---|")
            results["streamed"] = streamed_decode(engine, args, device, prompts)
            if device.type == "cuda":
                results["roofline"] = roofline(results, model_dir, dtype)
        print(f"\n(c) {args.hf_prompts} prompts x {args.new_tokens} new tokens")
        results["engine"] = engine_throughput(engine, prompts[:args.hf_prompts], args.new_tokens, device)
        print_throughput("engine (continuous batching)", results["engine"])
    finally:
        engine.close()
        del engine
        free_memory(device)
    if not args.no_hf:
        hf = hf_baselines(model_dir, prompts[:args.hf_prompts], args.new_tokens, dtype, device,
                          args.load_format == "dummy", pad_id, args.hf_serial_max)
        print_throughput("HF generate, one padded batch", hf["batch"])
        if "serial" in hf:
            print_throughput("HF generate, one at a time", hf["serial"])
        print_ratios(results["engine"], hf)
        results["hf"] = hf
    return results


def roofline(results: dict[str, Any], model_dir: Path, dtype: str) -> dict[str, float] | None:
    """Batch-1 decode ms/token against weight bytes / copy bandwidth (target: within 1.15x, issue 21)."""
    row = next((r for r in results["table"] if r["batch"] == 1), None)
    if row is None:
        print("(no batch size 1 in --batch-sizes: no roofline comparison)")
        return None
    streamed = next(r for r in results["streamed"] if r["batch"] == 1)["decode_ms"]
    weights = weight_bytes_per_token(model_dir, dtype)
    floor_ms = weights / (results["bandwidth_gb_s"] * 1e9) * 1e3
    ratio, streamed_ratio = row["decode_ms_p50"] / floor_ms, streamed / floor_ms
    print(f"batch-1 decode vs weights {weights / 1e9:.2f} GB / {results['bandwidth_gb_s']:.0f} GB/s = {floor_ms:.2f} ms"
          f" (target <= 1.15x): {row['decode_ms_p50']:.2f} ms/token stepped (a), {ratio:.3f}x; "
          f"{streamed:.2f} ms/token through generate (b), {streamed_ratio:.3f}x")
    return {"weight_gb": weights / 1e9, "floor_ms": floor_ms, "decode_ms": row["decode_ms_p50"], "ratio": ratio,
            "streamed_ms": streamed, "streamed_ratio": streamed_ratio}


if __name__ == "__main__":
    sys.exit(main())
