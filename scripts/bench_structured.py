"""Constrained decoding overhead: tok/s of a batch with a JSON schema on every request against the same batch
unconstrained, in one invocation (runs alternate, the best of each counts). Prints the ratio.

    PYTHONPATH=$PWD python scripts/bench_structured.py [--batch 16] [--max-new-tokens 64] [--rounds 3] [--threads 1]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# cannot close within the token budget, so both runs generate exactly batch x max_new_tokens tokens and the
# grammar is live at every step (names, numbers, punctuation, string bodies)
SCHEMA = {"type": "object", "properties": {"animals": {"type": "array", "minItems": 200, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                     "legs": {"type": "integer", "minimum": 0, "maximum": 8},
                                     "wild": {"type": "boolean"}},
    "required": ["name", "legs", "wild"], "additionalProperties": False}}}, "required": ["animals"]}


def run(engine, prompts: list[list[int]], params) -> tuple[float, int]:
    t0 = time.perf_counter()
    outputs = engine.generate(prompts, [params] * len(prompts))
    return time.perf_counter() - t0, sum(len(o.tokens) for o in outputs)


def main() -> None:
    from make_models import ensure_model

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams
    from engine.structured.spec import json_schema_spec
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (1 is steadier on a busy box)")
    args = parser.parse_args()
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    model_dir = args.model_dir or str(ensure_model("smollm2"))
    engine = LLMEngine(EngineConfig(model_id=model_dir, device=args.device, max_batch_size=args.batch))
    prompts = [engine.tokenizer.encode(f"List {i + 2} animals you saw at the zoo, as JSON:") for i in range(args.batch)]
    free = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    constrained = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True,
                                 grammar=json_schema_spec(SCHEMA, "schema"))
    run(engine, prompts[:2], free)          # warm-up: kernels, grammar tokenizer, compile cache
    run(engine, prompts[:2], constrained)
    best = {"unconstrained": 0.0, "json schema": 0.0}
    for _ in range(args.rounds):
        for name, params in (("unconstrained", free), ("json schema", constrained)):
            seconds, tokens = run(engine, prompts, params)
            best[name] = max(best[name], tokens / seconds)
            print(f"{name:14} {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.1f} tok/s", flush=True)
    import torch
    print(f"batch {args.batch}, {args.max_new_tokens} new tokens, device {engine.runner.device}, "
          f"torch threads {torch.get_num_threads()}, best of {args.rounds}")
    print(f"unconstrained {best['unconstrained']:.1f} tok/s, json schema {best['json schema']:.1f} tok/s, "
          f"ratio {best['json schema'] / best['unconstrained']:.3f}")
    engine.close()


if __name__ == "__main__":
    main()
