"""Engine speed per workload, in-process: output tok/s over wall and CPU time, TTFT and decode step time.

    python scripts/bench_workloads.py                                  # every workload, this checkout, once
    python scripts/bench_workloads.py --workloads p2048,shared1024 --repeat 3 --compare /tmp/main-tree
    python scripts/bench_workloads.py --workloads p1024 --profile      # torch.profiler tables, prefill / decode

Workloads (issue 20): N prompts of L tokens, all added at once (N = the concurrency), `--new-tokens` each,
greedy with ignore_eos, the engine at its defaults (KV cache, prefill budget, block size, backends):
p128/p512/p1024/p2048 = 16 prompts of 128..2048 tokens; shared1024 = 16 prompts of a shared 1024-token
system prompt + 128 own tokens; c64 = 64 prompts of 128 tokens. `--curve`: the model runner's decode step
(forward + logits, no sampler) at 16 sequences over contexts of 128, 512, 1024 and 2048 tokens, each
sequence on its own blocks; the cache holds whatever it holds (no prefill: the time does not depend on the
values), median CPU and wall ms of `--repeat` x 5 steps per context.

`--compare DIR` runs each workload in a subprocess of this checkout and of DIR (another checkout, e.g. main)
alternately, `--repeat` times, so both see the same load; medians are printed side by side. CPU time
(`process_time`, all threads) moves much less than wall time when others share the box; the TTFT is also read on
that clock (CPU-s from the start of the run to each first token). `--engine-config` given more than once runs
each config in turn the same way (e.g. two prefill budgets).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(HERE), str(HERE / "scripts")]  # this checkout's `engine` and bench_engine

# name -> (prompt tokens, shared prefix tokens, number of prompts)
WORKLOADS = {"p128": (128, 0, 16), "p512": (512, 0, 16), "p1024": (1024, 0, 16), "p2048": (2048, 0, 16),
             "shared1024": (128, 1024, 16), "c64": (128, 0, 64)}
CURVE = (128, 512, 1024, 2048)


def prompts_for(tokenizer, name: str, vocab_size: int) -> list[list[int]]:
    from bench_engine import make_prompts
    own, shared, num = WORKLOADS[name]
    bodies = make_prompts(tokenizer, num + 1, own + shared, vocab_size)
    if not shared:
        return bodies[:num]
    system = bodies[num][:shared]
    return [system + body[:own] for body in bodies[:num]]


def run_one(args: argparse.Namespace, name: str) -> dict:
    """Build the engine at its defaults, warm it up, run workload `name` once; a JSON-able summary."""
    import torch
    from bench_engine import greedy, resolve_model_dir
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    if args.threads:
        torch.set_num_threads(args.threads)
    config = EngineConfig(model_id=str(resolve_model_dir(args.model_id)), device="cpu",
                          **json.loads(args.engine_config))
    engine = LLMEngine(config)
    try:
        prompts = prompts_for(engine.tokenizer, name, engine.vocab_size)
        engine.generate([[1, 2, 3, 4] * 8], greedy(4))  # warm-up: first-call costs out of the timing
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{name}-{i}", prompt, greedy(args.new_tokens))
        first_token: dict[str, float] = {}
        first_token_cpu: dict[str, float] = {}  # the process's CPU clock: moves little with others' load
        decode_steps: list[float] = []
        profile = _profiler() if args.profile else None
        wall0, cpu0 = time.perf_counter(), time.process_time()
        while engine.has_unfinished_requests():
            start, start_cpu = time.perf_counter(), time.process_time()
            outputs = engine.step()
            elapsed, elapsed_cpu = time.perf_counter() - start, time.process_time() - start_cpu
            is_decode = bool(engine.scheduler.running) and all(
                s.num_computed_tokens >= s.num_prompt_tokens for s in engine.scheduler.running) and \
                engine.stats().batch_size == len(prompts)
            if profile is not None:
                profile.step(is_decode)
            if is_decode and len(first_token) == len(prompts):
                decode_steps.append((elapsed, elapsed_cpu))
            for out in outputs:
                first_token.setdefault(out.request_id, time.perf_counter() - wall0)
                first_token_cpu.setdefault(out.request_id, time.process_time() - cpu0)
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        if profile is not None:
            profile.report()
        generated = len(prompts) * args.new_tokens
        return {"workload": name, "tok_s": generated / wall, "tok_per_cpu_s": generated / cpu, "wall_s": wall,
                "cpu_s": cpu, "ttft_p50_s": statistics.median(first_token.values()),
                "ttft_cpu_p50_s": statistics.median(first_token_cpu.values()),
                "decode_step_ms": _median_ms(w for w, _ in decode_steps),
                "decode_step_cpu_ms": _median_ms(c for _, c in decode_steps),
                "prefix_hit_tokens": engine.block_manager.num_hit_tokens,
                "prefill_tokens": engine._num_prompt_tokens_total}
    finally:
        engine.close()


def _median_ms(seconds) -> float:
    values = list(seconds)
    return 1e3 * statistics.median(values) if values else float("nan")


class _profiler:
    """torch.profiler over the first step (a prefill) and the 4th pure decode step; op tables of both."""

    def __init__(self) -> None:
        import torch
        self._torch = torch
        self.tables: dict[str, object] = {}
        self.num_decode = 0
        self._start()

    def _start(self) -> None:
        self.prof = self._torch.profiler.profile(activities=[self._torch.profiler.ProfilerActivity.CPU])
        self.prof.__enter__()

    def step(self, is_decode: bool) -> None:
        if self.prof is not None:
            self.prof.__exit__(None, None, None)
            self.tables.setdefault("decode" if is_decode else "prefill", self.prof)
            self.prof = None
        self.num_decode += is_decode
        if self.num_decode == 3 and "decode" not in self.tables:
            self._start()

    def report(self) -> None:
        for kind, prof in self.tables.items():
            print(f"--- one {kind} step ---", file=sys.stderr)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18), file=sys.stderr)


def decode_curve(args: argparse.Namespace, num_seqs: int = 16) -> None:
    import torch
    from bench_engine import resolve_model_dir
    from engine.batch import SeqSpan
    from engine.config import EngineConfig
    from engine.model_runner import ModelRunner
    from engine.model_config import ModelConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    config = EngineConfig(model_id=str(resolve_model_dir(args.model_id)), device="cpu",
                          **json.loads(args.engine_config))
    runner = ModelRunner(config, ModelConfig.from_pretrained(config.model_id))
    try:
        bs = runner.block_size
        print(f"| context | decode step CPU ms | wall ms | (16 sequences, {runner.attention_backend}, blocks of {bs}) |")
        print("|---|---|---|---|")
        for context in CURVE:
            per_seq = -(-(context + 1) // bs)
            if num_seqs * per_seq > runner.num_kv_blocks:
                raise SystemExit(f"the KV cache has {runner.num_kv_blocks} blocks, {num_seqs * per_seq} needed")
            spans = [SeqSpan(b, [100 + b], context, list(range(b * per_seq, (b + 1) * per_seq)))
                     for b in range(num_seqs)]
            # the context as a prefill leaves it: written. Never-written pages all map the kernel's one zero page,
            # which reads from cache, not DRAM (the curve of 5daa579 measured that: 18 ms from 128 to 2,048)
            with torch.inference_mode():
                runner._rank0.kv_cache[:, :, :num_seqs * per_seq].normal_()
            runner.run(spans)  # warm-up
            cpu, wall = [], []
            for _ in range(5 * args.repeat):
                start, start_cpu = time.perf_counter(), time.process_time()
                runner.run(spans)
                wall.append(time.perf_counter() - start)
                cpu.append(time.process_time() - start_cpu)
            print(f"| {context} | {_median_ms(cpu):.1f} | {_median_ms(wall):.1f} | |", flush=True)
    finally:
        runner.close()


def run_tree(tree: Path, args: argparse.Namespace, name: str, engine_config: str) -> dict:
    command = [sys.executable, str(tree / "scripts" / "bench_workloads.py"), "--child", name,
               "--model-id", args.model_id, "--new-tokens", str(args.new_tokens), "--threads", str(args.threads),
               "--engine-config", engine_config]
    done = subprocess.run(command, cwd=tree, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{tree} {name} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-id", default="smollm2")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--curve", action="store_true", help="decode step time at 16 sequences over contexts "
                        + ", ".join(map(str, CURVE)))
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--compare", type=Path, help="another checkout to run alternately (the 'before')")
    parser.add_argument("--engine-config", action="append", help="EngineConfig fields as JSON, e.g. "
                        '\'{"prefix_caching": false}\'; given twice or more, the configs run alternately')
    parser.add_argument("--profile", action="store_true", help="print torch.profiler op tables (in-process)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    configs = args.engine_config or ["{}"]
    args.engine_config = configs[0]
    if args.child:
        print(json.dumps(run_one(args, args.child)))
        return
    if args.curve:
        decode_curve(args)
        return
    names = args.workloads.split(",")
    trees = [HERE] + ([args.compare.resolve()] if args.compare else [])
    runs = [(tree, config) for tree in trees for config in configs]
    results: dict[tuple[str, tuple[Path, str]], list[dict]] = {}
    for name in names:
        for _ in range(args.repeat):
            for tree, config in runs:
                result = run_one(args, name) if args.profile else run_tree(tree, args, name, config)
                results.setdefault((name, (tree, config)), []).append(result)
                print(f"{tree.name} {config} {json.dumps(result)}", file=sys.stderr, flush=True)
    print_table(names, runs, results)


def print_table(names, trees, results) -> None:
    keys = [("tok_s", "tok/s", "{:.1f}"), ("tok_per_cpu_s", "tok/CPU-s", "{:.1f}"),
            ("ttft_p50_s", "TTFT p50 s", "{:.2f}"), ("ttft_cpu_p50_s", "TTFT p50 CPU-s", "{:.2f}"),
            ("decode_step_ms", "decode step ms", "{:.0f}"),
            ("decode_step_cpu_ms", "decode step CPU ms", "{:.0f}"),
            ("prefill_tokens", "prefill tokens", "{:.0f}")]
    print("| workload | tree | config | " + " | ".join(title for _, title, _ in keys) + " |")
    print("|---|---|---|" + "---|" * len(keys))
    for name in names:
        for tree, config in trees:
            runs = results[(name, (tree, config))]
            cells = [fmt.format(statistics.median(r.get(key, float("nan")) for r in runs)) for key, _, fmt in keys]
            print(f"| {name} | {tree.name} | `{config}` | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
