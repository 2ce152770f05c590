"""The transformers backend against our native class on the same model, in-process (LLMEngine.generate).

    python scripts/bench_model_impl.py --model-id smollm2 --batch-sizes 1,16 --new-tokens 32 --runs 3

Both engines are loaded once in this process; each run does native then transformers for every batch size
(interleaved A/B, so load on a shared machine hits both alike). Generated tok/s per run, median of the runs,
and transformers / native. EOS is ignored, greedy.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # make_models, engine

from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

IMPLS = ("native", "transformers")


def model_dir(model_id: str) -> str:
    if Path(model_id).is_dir():
        return model_id
    from make_models import ensure_model
    return str(ensure_model(model_id))


def tokens_per_second(engine: LLMEngine, batch: int, prompt_len: int, new_tokens: int) -> tuple[float, float]:
    """(generated tokens per wall second, per second of this process's CPU time)."""
    vocab = engine.model_config.vocab_size
    prompts = [[(17 * i + 31 * j) % (vocab - 100) + 50 for j in range(prompt_len)] for i in range(batch)]
    params = [SamplingParams(max_new_tokens=new_tokens, ignore_eos=True) for _ in prompts]
    start, cpu = time.perf_counter(), time.process_time()
    outputs = engine.generate(prompts, params)
    elapsed, cpu_elapsed = time.perf_counter() - start, time.process_time() - cpu
    generated = sum(len(out.tokens) for out in outputs)
    return generated / elapsed, generated / cpu_elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-id", default="smollm2", help="snapshot dir or test-model name")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)
    path = model_dir(args.model_id)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    engines = {impl: LLMEngine(EngineConfig(model_id=path, device=args.device, dtype=args.dtype, model_impl=impl,
                                            prefix_caching=False, cpu_kv_cache_bytes=256 * 2**20))
               for impl in IMPLS}
    for engine in engines.values():  # warm-up
        tokens_per_second(engine, 2, args.prompt_len, 4)
    results = {(impl, b): [] for impl in IMPLS for b in batches}
    for run in range(args.runs):
        for batch in batches:
            for impl in IMPLS:
                results[impl, batch].append(tokens_per_second(engines[impl], batch, args.prompt_len, args.new_tokens))
    print(f"{args.model_id} on {args.device} ({args.dtype}, {torch.get_num_threads()} threads), prompt "
          f"{args.prompt_len} tokens, {args.new_tokens} new, median of {args.runs} interleaved runs")
    print("| batch | native tok/s (runs) | transformers tok/s (runs) | transformers / native | same, per CPU second |")
    print("|---|---|---|---|---|")
    for batch in batches:
        (native, native_cpu), (hf, hf_cpu) = (
            [statistics.median(run[k] for run in results[impl, batch]) for k in (0, 1)] for impl in IMPLS)
        runs = {impl: ", ".join(f"{run[0]:.1f}" for run in results[impl, batch]) for impl in IMPLS}
        print(f"| {batch} | {native:.1f} ({runs['native']}) | {hf:.1f} ({runs['transformers']}) | {hf / native:.2f} "
              f"| {hf_cpu / native_cpu:.2f} |", flush=True)
    for engine in engines.values():
        engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
