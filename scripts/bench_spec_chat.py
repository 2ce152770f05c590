"""Speculation methods on a chat, random-token or repetitive workload, in process: tok/s and acceptance, A/B.

    python scripts/bench_spec_chat.py --model-id smollm2 --concurrency 1 --num-requests 4 --new-tokens 64 \\
        --config off= --config layers12=speculate=3,speculative_layers=12 --rounds 3

Every --config NAME=FIELD=VALUE,... is one engine (EngineConfig fields; an empty list is no speculation),
all loaded at once; each round runs the same greedy requests through each engine in turn (A B C, then C B A, ...),
`--concurrency` requests in flight at a time, so every engine sees the same load drift. `--workload` picks the
prompts: `chat`, plain chat questions whose answers do not quote them (n-gram drafts find little there);
`random`, random token ids (seeded), where any draft is a guess the target rejects; `repeat`, chat requests to
copy a passage word for word, where drafting from the prompt pays. Prints per engine the
generated tok/s of each round (wall time, and per CPU-second of this process), their medians, the drafts
proposed and accepted, and whether each engine's tokens equal the first engine's (greedy: they should).
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `engine` importable from a checkout

QUESTIONS = [
    "What are three tips for staying productive while working from home?",
    "Explain why the sky is blue to a ten-year-old.",
    "Write a short poem about autumn leaves.",
    "What is the difference between a virus and a bacterium?",
    "Give me a simple recipe for pancakes.",
    "How does a refrigerator keep food cold?",
    "Suggest a name for a friendly robot and explain your choice.",
    "What should I pack for a weekend hiking trip?",
]


PASSAGE = ("The committee met on Tuesday to review the budget for the coming year. After a long discussion, "
           "the members agreed to fund the library, the swimming pool and the new bicycle lanes, and to postpone "
           "the renovation of the town hall until the spring.")
RANDOM_PROMPT_TOKENS = 64


def workload_prompts(tokenizer, workload: str, count: int) -> list[list[int]]:
    from engine.tokenizer import apply_chat_template
    if workload == "random":   # ids past the special tokens, the same for every run
        rng = random.Random(0)
        return [[rng.randrange(256, tokenizer.vocab_size) for _ in range(RANDOM_PROMPT_TOKENS)] for _ in range(count)]
    if workload == "repeat":
        questions = [f"Repeat this text word for word, and nothing else:\n\n{PASSAGE}"] * count
    else:
        questions = (QUESTIONS * 8)[:count]
    return [tokenizer.encode(apply_chat_template(tokenizer, [{"role": "user", "content": q}])) for q in questions]


def parse_config(text: str) -> tuple[str, dict[str, int]]:
    name, _, fields = text.partition("=")
    values = {}
    for item in filter(None, fields.split(",")):
        key, _, value = item.partition("=")
        values[key] = int(value) if value.lstrip("-").isdigit() else value
    return name, values


class ForwardCount:
    """The model work an engine did, counted at its runner (no clock, so no noise): forwards in units of one
    full target forward (a layer-skip draft forward of K of L layers counts K / L) and draft-model forwards."""

    def __init__(self, engine) -> None:
        self.target, self.draft = 0.0, 0
        self.run, num_layers = engine.runner.run, engine.model_config.num_hidden_layers

        def counted(spans, *args, **kwargs):
            if kwargs.get("draft"):
                self.draft += 1
            else:
                self.target += (kwargs.get("num_layers") or num_layers) / num_layers
            return self.run(spans, *args, **kwargs)
        engine.runner.run = counted


def drafts(engine) -> tuple[int, int, int]:
    stats = engine.stats()
    return (stats.num_speculative_proposed_total, stats.num_speculative_accepted_total,
            stats.num_speculative_paused_total)


def run_round(engine, prompts: list[list[int]], params, concurrency: int) -> tuple[float, float, list[list[int]]]:
    """Wall seconds, CPU seconds of this process (every thread: on a box shared with other work, the CPU
    time a round took moves far less with the others' load than its wall time), and the tokens."""
    start, cpu, tokens = time.perf_counter(), time.process_time(), []
    for i in range(0, len(prompts), concurrency):
        tokens += [[t.id for t in out.tokens] for out in engine.generate(prompts[i:i + concurrency], params)]
    return time.perf_counter() - start, time.process_time() - cpu, tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-id", default="smollm2", help="a snapshot dir, or a scripts/make_models.py name")
    parser.add_argument("--config", action="append", required=True, help="NAME=field=value,... (repeatable)")
    parser.add_argument("--concurrency", type=int, default=1, nargs="+", help="one or more, run in turn")
    parser.add_argument("--num-requests", type=int, default=0, help="per workload; 0 = its concurrency")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workload", choices=("chat", "random", "repeat"), default=["chat"], nargs="+",
                        help="one or more, run in turn (each at every --concurrency)")
    parser.add_argument("--kv-cache-mib", type=int, default=256)
    args = parser.parse_args(argv)
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams
    model_dir = args.model_id
    if not Path(model_dir).is_dir():
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "engine"))
        from fakes import test_model_path
        model_dir = str(test_model_path(model_dir))
    engines = {}
    for text in args.config:
        name, fields = parse_config(text)
        engines[name] = LLMEngine(EngineConfig(model_id=model_dir, device="cpu", dtype="float32",
                                               cpu_kv_cache_bytes=args.kv_cache_mib * 2**20, **fields))
    for engine in engines.values():
        engine.forward_count = ForwardCount(engine)
    first = next(iter(engines.values()))
    params = SamplingParams(max_new_tokens=args.new_tokens)
    print(f"model {model_dir}", flush=True)
    for workload in args.workload:
        prompts = workload_prompts(first.tokenizer, workload, max(args.num_requests, *args.concurrency))
        for concurrency in args.concurrency:  # --num-requests 0: `concurrency` requests, one batch of them
            print(f"workload {workload}", flush=True)
            run_workload(engines, prompts[:args.num_requests or concurrency], params, concurrency, args)
    for engine in engines.values():
        engine.close()
    print(f"load average after: {os.getloadavg()}")
    return 0


def run_workload(engines, prompts, params, concurrency, args) -> None:
    times: dict[str, list[float]] = {name: [] for name in engines}
    cpu_rates: dict[str, list[float]] = {name: [] for name in engines}
    outputs: dict[str, list[list[int]]] = {}
    before = {name: drafts(engine) for name, engine in engines.items()}
    work_before = {name: (e.forward_count.target, e.forward_count.draft) for name, e in engines.items()}
    print(f"{len(prompts)} prompts, concurrency {concurrency}, max_new_tokens "
          f"{args.new_tokens}, greedy, {args.rounds} interleaved rounds; load average {os.getloadavg()}", flush=True)
    for round_index in range(args.rounds):  # A B C, then C B A, ...: a load trend hits every engine alike
        order = list(engines.items())
        for name, engine in order if round_index % 2 == 0 else order[::-1]:
            seconds, cpu_seconds, outputs[name] = run_round(engine, prompts, params, concurrency)
            times[name].append(sum(map(len, outputs[name])) / seconds)
            cpu_rates[name].append(sum(map(len, outputs[name])) / cpu_seconds)
            proposed, accepted, paused = (now - then for now, then in zip(drafts(engine), before[name]))
            print(f"  round {len(times[name])} {name}: {times[name][-1]:.2f} tok/s, {cpu_rates[name][-1]:.2f} tok per "
                  f"CPU-s (drafts so far {proposed} proposed, "
                  f"{accepted} accepted, {paused} decodes paused); load {os.getloadavg()[0]:.1f}", flush=True)
    reference = next(iter(outputs.values()))
    for name, engine in engines.items():
        proposed, accepted, _ = (now - then for now, then in zip(drafts(engine), before[name]))
        target = engine.forward_count.target - work_before[name][0]
        draft = engine.forward_count.draft - work_before[name][1]
        num_tokens = sum(map(len, outputs[name])) * args.rounds
        work = f"; work: {target:.1f} target forwards ({target / num_tokens:.3f} per token)" + (
            f", {draft} draft-model forwards" if draft else "")
        rounds = " / ".join(f"{v:.2f}" for v in times[name])
        cpu = " / ".join(f"{v:.2f}" for v in cpu_rates[name])
        print(f"{name}: tok/s {rounds} (median {statistics.median(times[name]):.2f}); tok per CPU-s {cpu} (median "
              f"{statistics.median(cpu_rates[name]):.2f}); drafts "
              f"{proposed} proposed, {accepted} accepted ({accepted / max(proposed, 1):.0%}); tokens "
              f"{sum(map(len, outputs[name]))}, same as the first: {outputs[name] == reference}{work}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
