"""An uninterrupted offline batch against the same requests through `serve` + the openai client (issue 26).

    python scripts/bench_batch.py [--model-id smollm2] [--requests 128] [--max-tokens 16] [--before DIR] \
        [--concurrency 32,128] [--repeat 3] [--batch-workers 1,2] [--serve-cpu-threads 1,2]

Each repeat runs, one after the other on this machine: (a) `python -m engine.offline` over a fresh batch folder
holding the requests (the engine in-process, fed from the ledger; its own log gives the seconds from the first
claim to the last commit, model load excluded), then (b) for each concurrency, the same requests as chat
completions from the `openai` client (AsyncOpenAI, non-streaming, at most C in flight) against one
`python -m engine` started once (load excluded: timed from the first request to the last answer). Both engines
get the same flags; `--batch-workers 1,2` runs a batch per value, as N engine processes splitting the CPU threads
(`engine.offline --workers`), and `--serve-cpu-threads 1,2` starts one server per value (`--cpu-threads`
appended to its flags), each measured at every concurrency. It prints generated tok/s per run, the medians,
batch / best serve, and how many answers the
two agree on (greedy: they should all be equal).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from batch_done_when import requests as make_requests, runner_seconds  # noqa: E402


def model_dir(name: str) -> str:
    if Path(name).is_dir():
        return name
    return subprocess.run([sys.executable, str(ROOT / "scripts/make_models.py"), name, "--print-path"],
                          capture_output=True, text=True, check=True).stdout.strip()


def run_batch(model: str, src: Path, work: Path, engine_args: list[str],
              workers: int = 1, root: Path = ROOT) -> tuple[float, int, dict[str, str]]:
    """(seconds from first claim to last commit, generated tokens, {custom_id: answer}); `root`: the checkout
    whose engine runs it."""
    from tgi_hpc.batch.submission import batch_dir_of, identity_of, prepare
    out = work / f"batch-{time.monotonic_ns()}.jsonl"
    batch_dir = batch_dir_of(out)
    prepare(batch_dir, src, out, identity_of(model, "main", tuple(engine_args)), shard_size=None, jobs_count=1,
            lease_s=600, restart=True)
    log = subprocess.run([sys.executable, "-m", "engine.offline", "--batch-dir", str(batch_dir), "--model-id", model,
                          "--workers", str(workers), *engine_args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, check=True, cwd=root,
                         env={**os.environ, "PYTHONPATH": str(root)}).stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    tokens = sum(r["response"]["body"]["usage"]["completion_tokens"] for r in rows)
    seconds = runner_seconds(log) or float(re.findall(r"tok/s over ([\d.]+) s", log)[-1])
    return seconds, tokens, {r["custom_id"]: r["response"]["body"]["choices"][0]["message"]["content"] for r in rows}


async def run_serve(url: str, model: str, reqs: list[dict], concurrency: int) -> tuple[float, int, dict[str, str]]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="none", timeout=3600, max_retries=0)
    gate = asyncio.Semaphore(concurrency)
    answers: dict[str, str] = {}
    tokens = 0

    async def one(req: dict) -> None:
        nonlocal tokens
        async with gate:
            body = req["body"]
            resp = await client.chat.completions.create(model=model, messages=body["messages"],
                                                        max_tokens=body["max_tokens"], temperature=0)
        answers[req["custom_id"]] = resp.choices[0].message.content
        tokens += resp.usage.completion_tokens

    started = time.monotonic()
    await asyncio.gather(*(one(r) for r in reqs))
    seconds = time.monotonic() - started
    await client.close()
    return seconds, tokens, answers


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-id", default="smollm2")
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--concurrency", default="32,128")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--batch-workers", default="1", help="comma-separated --workers values, a batch row each")
    parser.add_argument("--threads-per-worker", type=int, default=0,
                        help="a batch of W workers gets --cpu-threads W x this (default: the engine args' threads)")
    parser.add_argument("--serve-cpu-threads", default="",
                        help="comma-separated --cpu-threads values, one server each (default: one server, the "
                             "flags as given)")
    parser.add_argument("--before", type=Path, default=None,
                        help="another checkout (e.g. `git worktree add /tmp/before main`): each batch row runs from "
                             "it too, as 'before ...', in the same repeats")
    parser.add_argument("--batch-args", default="",
                        help="more flags for the batch rows only (e.g. a throughput-oriented `--window 512 "
                             "--max-batch-prefill-tokens 8192`); the servers get --engine-args alone")
    parser.add_argument("--engine-args", default="--max-concurrent-requests 128 --max-total-tokens 512 "
                                                  "--kv-cache-bytes 256MiB")
    args = parser.parse_args()
    model = model_dir(args.model_id)
    engine_args = args.engine_args.split()
    levels = [int(c) for c in args.concurrency.split(",")]
    reqs = make_requests(args.requests, args.max_tokens)
    work = Path(tempfile.mkdtemp(prefix="bench-batch-"))
    src = work / "requests.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in reqs))

    from bench_http import Server, wait_healthy
    servers: dict[str, tuple[Server, str]] = {}
    for threads in [t for t in args.serve_cpu_threads.split(",") if t] or [""]:
        server = Server(Path(model), argparse.Namespace(load_format="auto", concurrency=max(levels), threads=None,
                                                        engine_args=args.engine_args), "float32", "cpu")
        server.cmd = [c for c in server.cmd if c not in ("--load-format", "auto")]
        i = server.cmd.index("--max-concurrent-requests")
        del server.cmd[i:i + 2]                               # the same flags as the batch: --engine-args
        if threads:
            server.cmd += ["--cpu-threads", threads]
        name = f"serve{f' {threads} thr' if threads else ''}"
        servers[name] = (server, server.start(600))
        asyncio.run(wait_healthy(servers[name][1], 120))
        asyncio.run(run_serve(servers[name][1], "m", reqs[:8], 8))     # warm-up, not counted
    workers = [int(w) for w in args.batch_workers.split(",")]
    roots = [(ROOT, "")] + ([(args.before.resolve(), "before ")] if args.before else [])
    names = {(w, root): prefix + "batch" + (f" {w} workers" if w > 1 else "") for w in workers for root, prefix in roots}
    results: dict[str, list[float]] = {**{n: [] for n in names.values()},
                                       **{f"{n} c={c}": [] for n in servers for c in levels}}
    agree: list[int] = []
    before_agree: list[dict[str, str]] = []
    try:
        for rep in range(args.repeat):
            for (w, root), batch_name in names.items():
                threads = ["--cpu-threads", str(w * args.threads_per_worker)] if args.threads_per_worker else []
                seconds, tokens, answers = run_batch(model, src, work, engine_args + args.batch_args.split() + threads,
                                                     w, root)
                if root == ROOT:
                    batch_answers = answers
                else:
                    before_agree.append(answers)
                results[batch_name].append(tokens / seconds)
                print(f"repeat {rep + 1}: {batch_name} {tokens} tokens in {seconds:.1f} s = {tokens / seconds:.1f} "
                      f"tok/s (load {os.getloadavg()[0]:.1f})", flush=True)
            for name, (_, url) in servers.items():
                for c in levels:
                    seconds, tokens, serve_answers = asyncio.run(run_serve(url, "m", reqs, c))
                    results[f"{name} c={c}"].append(tokens / seconds)
                    agree.append(sum(batch_answers[k] == v for k, v in serve_answers.items()))
                    print(f"repeat {rep + 1}: {name} c={c} {tokens} tokens in {seconds:.1f} s = "
                          f"{tokens / seconds:.1f} tok/s (load {os.getloadavg()[0]:.1f})", flush=True)
    finally:
        for server, _ in servers.values():
            server.stop()
    medians = {k: statistics.median(v) for k, v in results.items()}
    best = max((k for k in medians if k.startswith("serve")), key=medians.get)
    print("\n| run | tok/s per repeat | median |\n|---|---|---|")
    for k, v in results.items():
        print(f"| {k} | {', '.join(f'{x:.1f}' for x in v)} | {medians[k]:.1f} |")
    for batch_name in names.values():
        print(f"{batch_name} / best serve ({best}): {medians[batch_name] / medians[best]:.2f}x")
    print(f"answers equal in the last batch and serve: {min(agree)}..{max(agree)} of {len(reqs)}")
    if before_agree:
        same = [sum(batch_answers[k] == v for k, v in b.items()) for b in before_agree]
        print(f"answers equal in the last batch and each 'before' batch: {min(same)}..{max(same)} of {len(reqs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
