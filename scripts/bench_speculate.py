"""N-gram speculation over HTTP: the same prompt-copying workload against `--speculate 0` and `--speculate N`.

    python scripts/bench_speculate.py --model-id smollm2 --concurrency 1 --new-tokens 160
    python scripts/bench_speculate.py --speculate 5 --concurrency 4 -- ...   # any bench_http.py option after

Each prompt asks the (chat) model to repeat a piece of code with one change, which is where drafts from
the prompt pay off. Both servers run one after the other in this invocation (same box, same load), greedy,
so their outputs are the same; the script prints each run's bench_http summary, the drafts proposed and
accepted (from /metrics), and the tok/s ratio speculate N / speculate 0.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_http  # noqa: E402
from bench_engine import run_benchmark  # noqa: E402

SNIPPETS = [
    "def mean(values):\n    total = 0\n    for value in values:\n        total += value\n    return total / len(values)\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n",
    "def read_config(path):\n    with open(path) as f:\n        lines = f.read().splitlines()\n"
    "    return {k.strip(): v.strip() for k, v in (line.split('=', 1) for line in lines if '=' in line)}\n",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
]
CHANGES = ["Rename the function or class to something clearer.", "Add a docstring.", "Use type hints.",
           "Change the variable names to single letters."]


def copy_prompts(model_dir: Path, num: int) -> list[str]:
    from engine.tokenizer import apply_chat_template, load_tokenizer
    tokenizer = load_tokenizer(model_dir)
    prompts = []
    for i in range(num):
        question = (f"Repeat this Python code exactly, with one change: {CHANGES[i // len(SNIPPETS) % len(CHANGES)]}"
                    f"\n\n```python\n{SNIPPETS[i % len(SNIPPETS)]}```")
        prompts.append(apply_chat_template(tokenizer, [{"role": "user", "content": question}]))
    return prompts


async def speculation_counters(url: str) -> tuple[float, float]:
    import httpx
    async with httpx.AsyncClient(timeout=10.0) as client:
        text = (await client.get(f"{url}/metrics")).text

    def value(name: str) -> float:
        match = re.search(rf"^{name} ([0-9.e+]+)$", text, re.MULTILINE)
        return float(match.group(1)) if match else 0.0
    return value("tgi_speculative_proposed_tokens_total"), value("tgi_speculative_accepted_tokens_total")


def run_one(args: argparse.Namespace, model_dir: Path, dtype: str, device: Any, speculate: int,
            prompts: list[str]) -> dict[str, Any]:
    run_args = argparse.Namespace(**vars(args))
    run_args.engine_args = f"{args.engine_args} --speculate {speculate}"
    server = bench_http.Server(model_dir, run_args, dtype, device.type)
    try:
        url = server.start(args.startup_timeout_s)
        asyncio.run(bench_http.wait_healthy(url, args.startup_timeout_s))
        records = asyncio.run(bench_http.run_load(url, prompts, run_args, str(model_dir)))
        proposed, accepted = asyncio.run(speculation_counters(url))
    except BaseException:
        if server.log_path.exists():
            print(f"engine log (last lines):\n{server.log_tail()}", file=sys.stderr)
        raise
    finally:
        server.stop()
    summary = bench_http.summarize(records, run_args.concurrency)
    print(f"\n## --speculate {speculate}")
    bench_http.print_summary(summary, run_args)
    summary["proposed"], summary["accepted"] = proposed, accepted
    if proposed:
        tokens = summary.get("generated_tokens") or 1
        print(f"drafts: {proposed:.0f} proposed, {accepted:.0f} accepted ({accepted / proposed:.0%} of drafts; "
              f"{accepted / tokens:.0%} of generated tokens came from accepted drafts)")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--speculate", type=int, default=3, help="draft tokens per step of the second run")
    own, rest = parser.parse_known_args(argv)
    args = bench_http.parse_args(rest + ["--no-hf"])

    def run(args: argparse.Namespace, model_dir: Path, device: Any, dtype: str) -> dict[str, Any]:
        prompts = copy_prompts(model_dir, args.num_requests)
        print(f"model: {model_dir} ({dtype}, {device}); {len(prompts)} copy-with-one-change prompts, concurrency "
              f"{args.concurrency}, max_new_tokens {args.new_tokens}, greedy", flush=True)
        results = {f"speculate_{n}": run_one(args, model_dir, dtype, device, n, prompts) for n in (0, own.speculate)}
        base, spec = results["speculate_0"], results[f"speculate_{own.speculate}"]
        if base.get("completed") and spec.get("completed"):
            print(f"\nratio --speculate {own.speculate} / --speculate 0: {spec['tokens_per_s'] / base['tokens_per_s']:.2f}x "
                  f"generated tok/s; mean TPOT {base['tpot_s']['mean'] * 1e3:.1f} -> "
                  f"{spec['tpot_s']['mean'] * 1e3:.1f} ms")
        return {"engine": spec, **results}

    results = run_benchmark(args, run)
    return 0 if results["engine"].get("completed") else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
