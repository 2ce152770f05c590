"""Host cost of serving tokens over HTTP: the real server around a runner that answers at once.

    python scripts/host_overhead_http.py [--concurrency 256 --new-tokens 128 --vocab 4096] [--profile DIR]

On a GPU the step's forward runs on the device, and the server process's CPU decides how many tokens a
second it can hand out: scheduling, sampling's host part, detokenizing, and then, per token and stream,
the HTTP side (the event loop, SSE events, the socket writes), all under one GIL. This measures that host
path with no model: a child process serves `scripts/host_overhead.py`'s `InstantRunner` engine through the
real app (`engine.server.app.build_app`, uvicorn in a thread, the step loop in the main thread, as
`python -m engine` does), and the load generator of `tgi-hpc bench` (`tgi_hpc.workflows.bench.run_load`)
streams `--concurrency` greedy `/generate_stream` requests (or `/v1/completions` with `--openai`) from this
process. The logits are `--vocab` wide (4096 by default: on a GPU the vocabulary-wide math is the device's).

It prints output tok/s, TPOT, and the server's CPU time per generated token split by thread: `step` (the
engine loop) and `http` (uvicorn's event loop: requests, queues, SSE, sockets). With `--profile DIR`, each
thread runs under cProfile and DIR gets `step.prof` and `http.prof` (pstats). The last line reads
`serve host cost: N us/token (step S, http H) at concurrency C`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
REPO = Path(__file__).resolve().parents[1]


def serve(args: argparse.Namespace) -> None:
    """The child: the InstantRunner engine behind the real app until SIGINT; the ready file names its URL and
    the native ids of its step and HTTP threads (the parent reads their CPU time from /proc)."""
    import cProfile

    import uvicorn

    import host_overhead
    from bench_engine import resolve_model_dir
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from engine.launcher import bind_socket
    from engine.server.app import build_app

    shape = argparse.Namespace(vocab=args.vocab, context=args.context, steps=args.new_tokens, batch=args.concurrency)
    llm = host_overhead.build(shape, resolve_model_dir(args.model_id))
    llm.vocab_size = max(llm.vocab_size, len(llm.tokenizer))   # the prompts' ids; the logits stay --vocab wide
    config: EngineConfig = llm.config
    config.max_concurrent_requests = 2 * args.concurrency
    config.max_best_of = 1
    engine = AsyncEngine(llm)
    app = build_app(engine, config)
    sock = bind_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, lifespan="off", http=args.http_impl))
    tids: dict[str, int] = {"step": threading.get_native_id()}
    profiles = {name: cProfile.Profile() for name in ("step", "http")} if args.profile else {}

    async def run_server() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.02)
        host, port = sock.getsockname()[:2]
        Path(args.ready_file).write_text(json.dumps({"url": f"http://{host}:{port}", "tids": tids}))
        await task

    def http_main() -> None:
        tids["http"] = threading.get_native_id()
        if "http" in profiles:
            profiles["http"].runcall(asyncio.run, run_server())
        else:
            asyncio.run(run_server())

    http = threading.Thread(target=http_main, name="http", daemon=True)
    signal.signal(signal.SIGINT, lambda *_: setattr(server, "should_exit", True))
    http.start()
    from engine import gc_tuning
    gc_tuning.apply()       # as the launcher does before its step loop (TGI_HPC_GC_TUNING=0: not)
    try:
        if "step" in profiles:
            profiles["step"].runcall(engine.run_here, keep_running=http.is_alive)
        else:
            engine.run_here(keep_running=http.is_alive)
    finally:
        server.should_exit = True
        http.join(10)
        for name, prof in profiles.items():
            prof.dump_stats(str(Path(args.profile) / f"{name}.prof"))


def thread_cpu(pid: int) -> dict[int, float]:
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        out[int(task.name)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-id", default="smollm2", help="the tokenizer's snapshot (test-model name or dir)")
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--context", type=int, default=512, help="longest prompt, in tokens")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--openai", action="store_true", help="stream /v1/completions instead of /generate_stream")
    parser.add_argument("--http-impl", default="auto", help="uvicorn's --http (auto, h11, httptools)")
    parser.add_argument("--profile", help="cProfile both server threads into this folder")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ready-file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve(args)
        return 0
    from tgi_hpc.workflows.bench import LoadOptions, make_prompts, run_load, summarize

    work = Path(tempfile.mkdtemp(prefix="host-http-"))
    ready = work / "ready.json"
    cmd = [sys.executable, __file__, "--serve", "--ready-file", str(ready),
           "--model-id", args.model_id, "--concurrency", str(args.concurrency), "--new-tokens", str(args.new_tokens),
           "--context", str(args.context), "--vocab", str(args.vocab), "--http-impl", args.http_impl]
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
        cmd += ["--profile", str(Path(args.profile).resolve())]
    child = subprocess.Popen(cmd, cwd=REPO)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            if child.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("error: the server did not start")
            time.sleep(0.1)
        info = json.loads(ready.read_text())
        url, tids = info["url"], info["tids"]
        prompts = make_prompts(args.concurrency)
        opts = LoadOptions(concurrency=args.concurrency, num_requests=args.concurrency, new_tokens=args.new_tokens,
                           timeout_s=300, openai=args.openai, max_duration_s=120)
        asyncio.run(run_load(url, {}, "instant", opts, prompts=prompts[:2]))   # warm-up
        before = thread_cpu(child.pid)
        start = time.perf_counter()
        records = asyncio.run(run_load(url, {}, "instant", opts, prompts=prompts))
        wall = time.perf_counter() - start
        after = thread_cpu(child.pid)
    finally:
        child.send_signal(signal.SIGINT)
        try:
            child.wait(30)
        except subprocess.TimeoutExpired:
            child.kill()
    summary = summarize(records, args.concurrency)
    if summary["failed"]:
        print("errors:", summary["errors"])
    tokens = sum(r.num_tokens for r in records if r.error is None)
    print(f"{args.concurrency} streams x {args.new_tokens} tokens, vocab {args.vocab}, "
          f"{'/v1/completions' if args.openai else '/generate_stream'}, http {args.http_impl}: "
          f"{tokens} tokens in {wall:.2f} s = {tokens / wall:.0f} tok/s; TPOT p50 "
          f"{summary['tpot_s']['p50'] * 1e3:.1f} ms; errors {sum(r.error is not None for r in records)}")
    used = {t: after[t] - before.get(t, 0.0) for t in after}
    total = sum(used.values())
    step, http = used.get(tids["step"], 0.0), used.get(tids["http"], 0.0)
    us = 1e6 / max(tokens, 1)
    print(f"server CPU: {total:.2f} s in all, step thread {step:.2f} s, http thread {http:.2f} s, "
          f"other threads {total - step - http:.2f} s")
    print(f"serve host cost: {total * us:.0f} us/token (step {step * us:.0f}, http {http * us:.0f}) "
          f"at concurrency {args.concurrency}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
