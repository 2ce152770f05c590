"""Multi-LoRA throughput: 16 concurrent requests spread over 4 adapters against the base model alone.

    python scripts/bench_lora.py                                  # SmolLM2, CPU fp32, rank 16, all targets
    python scripts/bench_lora.py --device cuda --dtype bfloat16 --model-id /path/to/model --rank 32

Builds --adapters random PEFT adapters (the real `peft` library, every q/k/v/o and MLP projection) in a
temp dir, then in one process and alternating, --repeats times each:
  base       an engine without adapters, 16 requests;
  lora-base  the engine with the adapters loaded, 16 requests on the base model (the cost of having them);
  lora-mixed the same engine, request i on adapter i % 4 (one batch mixes all four).
Every request has the same prompt length and --new-tokens (ignore_eos). Prints tok/s (generated tokens over
wall time, and over this process's CPU time: steadier on a shared machine) per run and the medians' ratios
against `base` from the same invocation.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts"), str(ROOT / "tests" / "engine")]

from bench_engine import CORPUS, machine_info  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_adapters(model_dir: str, out: Path, count: int, rank: int) -> list[tuple[str, str]]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    pairs = []
    for i in range(count):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        torch.manual_seed(i)
        peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                                                      init_lora_weights=False))
        peft_model.save_pretrained(out / f"adapter{i}")
        pairs.append((f"adapter{i}", str(out / f"adapter{i}")))
    return pairs


def run(engine: LLMEngine, prompts: list[list[int]], adapters: list[str | None], new_tokens: int
        ) -> tuple[float, float]:
    """(generated tokens per wall second, per CPU second of this process)."""
    params = [SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, adapter_id=a) for a in adapters]
    start, cpu = time.perf_counter(), time.process_time()
    outs = engine.generate(prompts, params)
    elapsed, cpu_s = time.perf_counter() - start, time.process_time() - cpu
    tokens = sum(len(o.tokens) for o in outs)
    return tokens / elapsed, tokens / cpu_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-id", default=None, help="snapshot dir (default: SmolLM2 from make_models.py)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model_id is None:
        from make_models import ensure_model
        args.model_id = str(ensure_model("smollm2"))
    common = dict(model_id=args.model_id, device=args.device, dtype=args.dtype, cpu_kv_cache_bytes=256 * 2**20)
    with tempfile.TemporaryDirectory() as tmp:
        pairs = build_adapters(args.model_id, Path(tmp), args.adapters, args.rank)
        base = LLMEngine(EngineConfig(**common))
        lora = LLMEngine(EngineConfig(**common, lora_adapters=pairs))
        ids = base.tokenizer.encode(CORPUS * 4)
        prompts = [ids[i * 7:i * 7 + args.prompt_len] for i in range(args.requests)]
        names = [name for name, _ in pairs]
        cases = {"base": (base, [None] * args.requests),
                 "lora-base": (lora, [None] * args.requests),
                 "lora-mixed": (lora, [names[i % len(names)] for i in range(args.requests)])}
        for engine, adapters in cases.values():  # warm-up
            run(engine, prompts[:2], adapters[:2], 4)
        results: dict[str, list[float]] = {name: [] for name in cases}
        per_cpu_s: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.repeats):
            for name, (engine, adapters) in cases.items():
                wall, cpu = run(engine, prompts, adapters, args.new_tokens)
                results[name].append(wall)
                per_cpu_s[name].append(cpu)
                print(f"{name:11s} {wall:8.1f} tok/s {cpu:8.1f} tok/CPU-s", file=sys.stderr)
        backend = lora.runner.lora_backend
        base.close()
        lora.close()
    medians = {name: statistics.median(values) for name, values in results.items()}
    cpu_medians = {name: statistics.median(values) for name, values in per_cpu_s.items()}
    print(json.dumps({"machine": machine_info(torch.device(args.device)), "args": vars(args), "lora_backend": backend,
                      "tok_s": results, "median_tok_s": medians,
                      "ratio_vs_base": {name: round(m / medians["base"], 3) for name, m in medians.items()},
                      "tok_per_cpu_s": per_cpu_s, "median_tok_per_cpu_s": cpu_medians,
                      "cpu_ratio_vs_base": {name: round(m / cpu_medians["base"], 3) for name, m in cpu_medians.items()}},
                     indent=1))


if __name__ == "__main__":
    main()
