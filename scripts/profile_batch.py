"""Where a batch spends its CPU, against the same requests through `serve` + the openai client (issue 26).

    python scripts/profile_batch.py [--model-id smollm2] [--requests 64] [--max-tokens 16] [--concurrency 64] \
        [--engine-args "..."]

CPU seconds (not wall time: this box is shared), per 1,000 generated tokens:
- batch, in this process: a `BatchRunner` over a fresh batch folder, split into the model's forward
  (`runner.run`), the rest of `LLMEngine.step` (scheduler, sampler, detokenizer), request admission (claims,
  preparing lines, `add_request`), collecting results (response lines) and writing (journal, commit); and
  how many requests each step ran (mean and max);
- serve: one `python -m engine` (its main thread, which runs the model, and its other threads: HTTP), and
  this process's openai client, for the same requests at `--concurrency`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from batch_done_when import requests as make_requests  # noqa: E402
from bench_batch import model_dir, run_serve  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> tuple[float, float]:
    """(main thread, other threads) CPU seconds of process `pid`."""
    main = other = 0.0
    for task in Path(f"/proc/{pid}/task").iterdir():
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        seconds = (int(fields[11]) + int(fields[12])) / TICK
        if int(task.name) == pid:
            main = seconds
        else:
            other += seconds
    return main, other


class Clock:
    """CPU seconds of this thread spent in each wrapped callable (nested calls counted once, in the inner)."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}
        self._stack: list[str] = []

    def wrap(self, obj: object, name: str, label: str) -> None:
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            start = time.thread_time()
            self._stack.append(label)
            try:
                return inner(*args, **kwargs)
            finally:
                self._stack.pop()
                spent = time.thread_time() - start
                self.spent[label] = self.spent.get(label, 0.0) + spent
                if self._stack:          # not in the caller's own time
                    self.spent[self._stack[-1]] = self.spent.get(self._stack[-1], 0.0) - spent
        setattr(obj, name, timed)


def profile_batch(model: str, src: Path, work: Path, engine_args: list[str]) -> dict:
    import torch

    from engine.launcher import parse_args, resolve_model_dir, to_config
    from engine.llm_engine import LLMEngine
    from engine.offline.requests import OfflineState
    from engine.offline.runner import BatchRunner
    from tgi_hpc.batch.ledger import Ledger
    from tgi_hpc.batch.submission import batch_dir_of, identity_of, prepare

    args = parse_args(["--model-id", model, *engine_args])
    if args.cpu_threads is not None:
        torch.set_num_threads(args.cpu_threads)
    config = to_config(args, resolve_model_dir(args.model_id, args.revision))
    llm = LLMEngine(config)
    out = work / "batch.jsonl"
    batch_dir = batch_dir_of(out)
    prepare(batch_dir, src, out, identity_of(model, "main", tuple(engine_args)), shard_size=None, jobs_count=1,
            lease_s=600, restart=True)
    runner = BatchRunner(llm, OfflineState.of(llm, config), Ledger(batch_dir, lease_s=600), "profile",
                         window=config.max_concurrent_requests)
    clock, sizes = Clock(), []
    clock.wrap(llm.runner, "run", "model forward (runner.run)")
    clock.wrap(llm, "step", "rest of LLMEngine.step (scheduler, sampler, detokenizer)")
    clock.wrap(runner, "_feed", "admission (claim, prepare lines, add_request)")
    clock.wrap(runner, "_collect", "collecting (response lines)")
    clock.wrap(runner, "_write_journals", "writing (journal appends)")
    clock.wrap(runner, "_commit", "writing (commits)")
    step = llm.step

    def counted():
        outputs = step()
        sizes.append(llm.stats().batch_size)
        return outputs
    llm.step = counted
    started, wall = time.thread_time(), time.monotonic()
    summary = runner.run()
    total, wall = time.thread_time() - started, time.monotonic() - wall
    llm.close()
    parts = dict(clock.spent)
    parts["other (the runner's loop)"] = total - sum(parts.values())
    return {"tokens": summary.generated_tokens, "cpu_s": total, "wall_s": wall, "parts": parts,
            "steps": len(sizes), "mean_batch": sum(sizes) / max(len(sizes), 1), "max_batch": max(sizes, default=0)}


def profile_serve(model: str, reqs: list[dict], concurrency: int, engine_args: str) -> dict:
    from bench_http import Server, wait_healthy

    server = Server(Path(model), argparse.Namespace(load_format="auto", concurrency=concurrency, threads=None,
                                                    engine_args=engine_args), "float32", "cpu")
    server.cmd = [c for c in server.cmd if c not in ("--load-format", "auto")]
    i = server.cmd.index("--max-concurrent-requests")
    del server.cmd[i:i + 2]
    url = server.start(600)
    try:
        asyncio.run(wait_healthy(url, 120))
        asyncio.run(run_serve(url, "m", reqs[:8], 8))            # warm-up, not counted
        pid = server.process.pid
        main0, other0 = thread_cpu(pid)
        client0 = time.process_time()
        seconds, tokens, _ = asyncio.run(run_serve(url, "m", reqs, concurrency))
        client = time.process_time() - client0
        main1, other1 = thread_cpu(pid)
    finally:
        server.stop()
    return {"tokens": tokens, "wall_s": seconds, "parts": {"server main thread (model, step loop)": main1 - main0,
                                                          "server other threads (HTTP)": other1 - other0,
                                                          "openai client (this process)": client}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-id", default="smollm2")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--engine-args", default="--max-concurrent-requests 128 --max-total-tokens 512 "
                                                  "--kv-cache-bytes 256MiB --cpu-threads 1")
    args = parser.parse_args()
    model = model_dir(args.model_id)
    reqs = make_requests(args.requests, args.max_tokens)
    work = Path(tempfile.mkdtemp(prefix="profile-batch-"))
    src = work / "requests.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    batch = profile_batch(model, src, work, args.engine_args.split())
    serve = profile_serve(model, reqs, args.concurrency, args.engine_args)
    for name, run in (("batch", batch), (f"serve c={args.concurrency}", serve)):
        per = 1000 / max(run["tokens"], 1)
        total = sum(run["parts"].values())
        print(f"\n{name}: {run['tokens']} tokens, {run['wall_s']:.1f} s wall, {total:.2f} CPU s "
              f"= {total * per:.2f} CPU s per 1k tokens (load {os.getloadavg()[0]:.1f})")
        if "steps" in run:
            print(f"  {run['steps']} steps, {run['mean_batch']:.1f} requests per step on average, "
                  f"{run['max_batch']} at most")
        for part, seconds in run["parts"].items():
            print(f"  {part:<60} {seconds:7.2f} s {seconds * per:7.3f} /1k tok {100 * seconds / total:5.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
