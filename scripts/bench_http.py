"""HTTP load generator for `python -m engine`: TTFT, TPOT, ITL, end-to-end latency, throughput; HF baseline.

    python scripts/bench_http.py --model-id smollm2 --concurrency 16 --new-tokens 64      # CPU, fp32
    python scripts/bench_http.py --openai ...                # /v1/completions stream instead of /generate_stream
    python scripts/bench_http.py --url http://127.0.0.1:8080 --model-id smollm2   # a server already running
    python scripts/bench_http.py --config-like 8b --load-format dummy --device cuda \\
        --concurrency 256 --new-tokens 128                  # GPU, Llama-3.1-8B shape, random weights

It starts the engine as a subprocess on 127.0.0.1 (a free port), runs `--num-requests` greedy
requests (default: one wave of `--concurrency`) from `--concurrency` closed-loop streaming clients,
stops the server, then runs the same prompts through HF transformers `generate` as padded batches
of `--hf-batch-size` in this process (so the two never compete for the CPU), and prints aggregate
generated tok/s engine / HF. Loopback only; every request and the whole run are time-bounded.

The load generator, its definitions (TTFT, TPOT, ITL, E2E, throughput) and the prefill/decode tables are
`tgi_hpc/workflows/bench.py`'s, which `tgi-hpc bench` runs against a cluster job.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse


sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import (CONFIGS_LIKE, free_memory, hf_generate, load_hf_model, print_throughput,  # noqa: E402
                          run_benchmark)

from tgi_hpc.workflows.bench import LoadOptions, Record, make_prompts, summarize, tables  # noqa: E402
from tgi_hpc.workflows.bench import run_load as load  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")
# --- the server -----------------------------------------------------------------------------------

class Server:
    """`python -m engine` on 127.0.0.1 with a free port; its log goes to a temp file."""

    def __init__(self, model_dir: Path, args: argparse.Namespace, dtype: str, device: str) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="bench-http-"))
        self.ready_file = self.workdir / "ready.json"
        self.log_path = self.workdir / "engine.log"
        self.cmd = [sys.executable, "-m", "engine", "--model-id", str(model_dir), "--hostname", "127.0.0.1",
                    "--port", "0", "--ready-file", str(self.ready_file), "--load-format", args.load_format,
                    "--dtype", dtype, "--device", device,
                    "--max-concurrent-requests", str(max(128, 2 * args.concurrency)),
                    *shlex.split(args.engine_args)]
        self.threads = args.threads
        self.process: subprocess.Popen | None = None
        self.url = ""

    def start(self, timeout_s: float) -> str:
        print("starting: " + shlex.join(self.cmd), flush=True)
        env = dict(os.environ)
        if self.threads:  # torch reads it at start-up, and the launcher then leaves its default (--cpu-threads)
            env["OMP_NUM_THREADS"] = str(self.threads)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout_s
        while not self.ready_file.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                tail = self.log_tail()  # before stop() deletes the log
                self.stop()
                raise SystemExit(f"error: the engine did not start (exit code {self.process.returncode}); "
                                 f"last log lines:\n{tail}")
            time.sleep(0.2)
        ready = json.loads(self.ready_file.read_text())
        self.url = f"http://{ready['host']}:{ready['port']}"
        return self.url

    def cpu_seconds(self) -> float | None:
        """utime + stime of the server process (all its threads), from /proc; None where unknown."""
        try:
            fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, AttributeError, IndexError):
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)  # uvicorn's graceful stop
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        shutil.rmtree(self.workdir, ignore_errors=True)


async def wait_healthy(url: str, timeout_s: float) -> None:
    import httpx
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        while True:
            try:
                if (await client.get(f"{url}/health")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"error: {url}/health did not answer 200 within {timeout_s:.0f} s")
            await asyncio.sleep(0.5)


# --- the load -------------------------------------------------------------------------------------

async def fetch_info(url: str) -> dict[str, Any]:
    import httpx

    async with httpx.AsyncClient(timeout=10.0) as client:
        response = await client.get(f"{url}/info")
        response.raise_for_status()
        return response.json()


async def run_load(url: str, prompts: list[str], args: argparse.Namespace, model_name: str) -> list[Record]:
    """`--concurrency` closed-loop clients; no new request starts after --max-duration-s."""
    opts = LoadOptions(concurrency=args.concurrency, num_requests=len(prompts), new_tokens=args.new_tokens,
                       timeout_s=args.max_duration_s + args.request_timeout_s, openai=args.openai,
                       max_duration_s=args.max_duration_s)
    return await load(url, {}, model_name, opts, prompts=prompts)


_START: Any = None   # a client process's barrier: every process imported and ready before any sends


def _client_init(barrier: Any) -> None:
    global _START
    _START = barrier


def _client_process(url: str, prompts: list[str], args: argparse.Namespace,
                    model_name: str) -> tuple[list[Record], float]:
    _START.wait(120)
    start = time.process_time()
    records = asyncio.run(run_load(url, prompts, args, model_name))
    return records, time.process_time() - start


def run_load_processes(url: str, prompts: list[str], args: argparse.Namespace,
                       model_name: str) -> tuple[list[Record], float]:
    """The clients split over --client-processes processes (the clients' share of the prompts each), so that
    one Python process parsing every SSE event does not cap what a fast server can hand out. Records keep
    perf_counter times, which are CLOCK_MONOTONIC: comparable across processes. Returns the records and the
    client processes' CPU seconds while they ran the load (not their start-up)."""
    import concurrent.futures
    import multiprocessing

    procs = min(args.client_processes, args.concurrency)
    shares = [prompts[i::procs] for i in range(procs)]
    sub = [argparse.Namespace(**{**vars(args), "concurrency": len(range(i, args.concurrency, procs))})
           for i in range(procs)]
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(procs, mp_context=context, initializer=_client_init,
                                                initargs=(context.Barrier(procs),)) as pool:
        parts = list(pool.map(_client_process, [url] * procs, shares, sub, [model_name] * procs))
    return [record for records, _ in parts for record in records], sum(cpu for _, cpu in parts)


# --- report ---------------------------------------------------------------------------------------

def print_summary(summary: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"\nengine over HTTP ({'/v1/completions' if args.openai else '/generate_stream'}), finish reasons "
          f"{summary['finish_reasons']}")
    print(tables([summary]), flush=True)
    if summary.get("server_cpu_s"):
        print(f"CPU time: server {summary['server_cpu_s']:.1f} CPU-s ({summary['tok_per_cpu_s']:.1f} tok/CPU-s), "
              f"load generator {summary['client_cpu_s']:.1f} CPU-s")


# --- HF baseline ----------------------------------------------------------------------------------

def hf_baseline(model_dir: Path, prompts: list[str], args: argparse.Namespace, dtype: str,
                device: Any) -> dict[str, Any]:
    """The same prompts (tokenized as the server does) through HF generate, padded batches."""
    from engine.tokenizer import load_tokenizer
    tokenizer = load_tokenizer(model_dir)
    ids = [list(tokenizer.encode(p, add_special_tokens=True)) for p in prompts]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id or 0
    model = load_hf_model(model_dir, dtype, device, args.load_format == "dummy")
    hf_generate(model, ids[:1], 2, 1, pad_id, device)  # warm-up
    result = {"batch": hf_generate(model, ids, args.new_tokens, args.hf_batch_size or args.concurrency,
                                   pad_id, device)}
    if args.hf_serial_max:
        result["serial"] = hf_generate(model, ids[:args.hf_serial_max], args.new_tokens, 1, pad_id, device)
    del model
    free_memory(device)
    return result


# --- main -----------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-id", default="smollm2", help="snapshot dir or test-model name")
    parser.add_argument("--url", help="benchmark this running server (loopback) instead of starting one")
    parser.add_argument("--load-format", default="safetensors", choices=["safetensors", "dummy"])
    parser.add_argument("--config-like", choices=sorted(CONFIGS_LIKE), help="random weights of this shape "
                        "(Llama-3.1-8B); needs --load-format dummy, meant for a GPU")
    parser.add_argument("--config-override", nargs="*", default=[], metavar="KEY=VALUE",
                        help="patch the --config-like config (e.g. num_hidden_layers=2 to try it on CPU)")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"],
                        help="default: float32 on CPU, bfloat16 on GPU")
    parser.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--engine-args", default="", help="extra `python -m engine` flags, one string")
    parser.add_argument("--openai", action="store_true", help="stream /v1/completions instead of /generate_stream")
    parser.add_argument("--concurrency", type=int, default=16, help="concurrent streaming clients")
    parser.add_argument("--client-processes", type=int, default=1,
                        help="split the clients over this many processes (on the H200, one process streaming 256 "
                             "clients at 5.6k tok/s used 88%% of a core: the client may be the limit)")
    parser.add_argument("--num-requests", type=int, help="requests in all (default: --concurrency)")
    parser.add_argument("--new-tokens", type=int, default=64, help="max_new_tokens per request (greedy)")
    parser.add_argument("--max-duration-s", type=float, default=120.0, help="no new request after this")
    parser.add_argument("--request-timeout-s", type=float, default=180.0)
    parser.add_argument("--startup-timeout-s", type=float, default=600.0)
    parser.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    parser.add_argument("--hf-batch-size", type=int, help="HF padded batch size (default: --concurrency)")
    parser.add_argument("--hf-serial-max", type=int, default=0,
                        help="also run this many prompts through HF one at a time")
    parser.add_argument("--threads", type=int, help="torch CPU threads of the server (OMP_NUM_THREADS) and of "
                        "the HF baseline (default: each its own: the server every core but one, HF one per core)")
    parser.add_argument("--json-out", help="also write every number to this JSON file")
    args = parser.parse_args(argv)
    args.num_requests = args.num_requests or args.concurrency
    return args


def check_loopback(url: str) -> str:
    host = urlparse(url).hostname or ""
    if host not in LOOPBACK and f"[{host}]" not in LOOPBACK:
        raise SystemExit(f"error: --url {url} is not a loopback address; this load generator only targets "
                         "127.0.0.1/localhost (use an SSH tunnel to reach a cluster job)")
    return url.rstrip("/")


def main(argv: list[str] | None = None) -> int:
    results = run_benchmark(parse_args(argv), run)
    return 0 if results["engine"]["completed"] else 1


def run(args: argparse.Namespace, model_dir: Path, device: Any, dtype: str) -> dict[str, Any]:
    prompts = make_prompts(args.num_requests)
    print(f"model: {args.config_like or model_dir} ({args.load_format}, {dtype}, {device}); {args.num_requests} "
          f"requests, concurrency {args.concurrency}, max_new_tokens {args.new_tokens}, greedy", flush=True)
    server = None if args.url else Server(model_dir, args, dtype, device.type)
    try:
        url = check_loopback(args.url) if args.url else server.start(args.startup_timeout_s)
        asyncio.run(wait_healthy(url, args.startup_timeout_s))
        info = asyncio.run(fetch_info(url))
        print(f"engine backends: attention {info.get('attention_backend')}, linear {info.get('linear_backend')}, "
              f"decode CUDA graphs {info.get('cuda_graphs') or 'none'}")
        model_name = str(model_dir)
        server_cpu = server.cpu_seconds() if server else None
        client_cpu = time.process_time()
        if args.client_processes > 1:
            records, client_cpu = run_load_processes(url, prompts, args, model_name)
        else:
            records = asyncio.run(run_load(url, prompts, args, model_name))
            client_cpu = time.process_time() - client_cpu
        if server_cpu is not None:
            server_cpu = server.cpu_seconds() - server_cpu
    except BaseException:
        if server is not None and server.log_path.exists():  # start() already showed it otherwise
            print(f"engine log (last lines):\n{server.log_tail()}", file=sys.stderr)
        raise
    finally:
        if server is not None:
            server.stop()
    summary = summarize(records, args.concurrency)
    summary["client_cpu_s"], summary["server_cpu_s"] = client_cpu, server_cpu
    if server_cpu and summary["completed"]:
        summary["tok_per_cpu_s"] = summary["generated_tokens"] / server_cpu
    print_summary(summary, args)
    summary["backends"] = {"attention": info.get("attention_backend"), "linear": info.get("linear_backend"),
                           "cuda_graphs": info.get("cuda_graphs")}
    results: dict[str, Any] = {"engine": summary}
    if args.no_hf or not summary["completed"]:
        return results
    done = prompts[:summary["completed"] + summary["failed"]]  # what was actually sent
    hf = hf_baseline(model_dir, done, args, dtype, device)
    print()
    print_throughput(f"HF generate, padded batches of {args.hf_batch_size or args.concurrency}", hf["batch"])
    if "serial" in hf:
        print_throughput("HF generate, one at a time", hf["serial"])
    for kind, result in hf.items():
        cpu = (f", {summary['tok_per_cpu_s'] / result['tok_per_cpu_s']:.2f}x tok/CPU-s"
               if summary.get("tok_per_cpu_s") and result.get("tok_per_cpu_s") else "")
        print(f"ratio engine (HTTP, {args.concurrency} streams) / HF {kind}: "
              f"{summary['tokens_per_s'] / result['tok_s']:.2f}x aggregate generated tok/s{cpu}")
    results["hf"] = hf
    return results


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
