"""The HTTP load generator of `tgi-hpc bench` and scripts/bench_http.py: closed-loop streaming clients against a
running server; prefill and decode tables (TTFT, TPOT, tok/s by percentile) per concurrency, and throughput.
`bench()` reaches a job or service the usual way (tgi_hpc.workflows.access: direct on the cluster, a tunnel
from a laptop); the script starts its own server on 127.0.0.1 and calls the same `run_load` and `summarize`.

Definitions (per request; percentiles over requests, ITL over every gap between two tokens):
TTFT = first token - request sent; TPOT = (last token - first token) / (tokens - 1);
ITL = time between consecutive streamed tokens; E2E = end of the response - request sent;
prefill tok/s = prompt tokens / TTFT; decode tok/s = 1 / TPOT (one stream's rate).
Throughput = completed requests (generated tokens) / (last response end - first request sent).
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tgi_hpc.errors import UsageError

# prompts of different lengths; greedy SmolLM2-135M-Instruct runs each to 64 tokens without EOS
PROMPTS = [
    "Explain in detail how a compiler turns source code into machine code.",
    "Describe a walk through a busy market in a coastal town, with all the sounds and smells.",
    "List the steps to bake sourdough bread at home and explain why each step matters.",
    "Once upon a time, in a kingdom far away, there lived a young inventor who",
    "The history of the printing press begins",
    "Describe how photosynthesis works, from sunlight to sugar, for a curious teenager.",
    "Tell the story of a cat that wanted to become a sailor.",
    "The old train station had been closed for twenty years, until one night",
    "The history of the printing press begins in the fifteenth century, when",
    "In the small village of Brookfield, the annual harvest festival was",
    "Chapter 1\n\nThe rain had not stopped for three days, and",
    "The mitochondria is often called the powerhouse of the cell because",
    "Python is a programming language that",
    "Dear diary, today was the strangest day of my life. It started when",
    "Slurm is a workload manager used on many supercomputers. To submit a job,",
    "The first computers filled whole rooms, and the engineers who ran them",
]
QUANTILES = (50, 90, 99)


@dataclass
class LoadOptions:
    concurrency: int = 8
    num_requests: int | None = None     # default: `runs` waves of `concurrency`
    runs: int = 4                       # requests per client when num_requests is None
    new_tokens: int = 64
    timeout_s: float = 600.0            # the whole run, and each request
    openai: bool = True                 # /v1/completions; False: TGI's /generate_stream
    max_duration_s: float | None = None   # no new request after this
    warmup: int = 0                     # requests sent (and not counted) before the measured ones
    sequence_length: int | None = None  # prompt tokens of every request (None: PROMPTS as they are)


@dataclass(slots=True)
class Record:
    sent: float
    token_times: list[float] = field(default_factory=list)
    num_tokens: int = 0                 # from the final event (usage / details) when given, else streamed events
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    end: float = 0.0
    error: str | None = None


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def make_prompts(num: int) -> list[str]:
    """`num` distinct prompts: the list, then numbered variants of it."""
    return [PROMPTS[i % len(PROMPTS)] + ("" if i < len(PROMPTS) else f" (Part {i // len(PROMPTS) + 1}.)")
            for i in range(num)]


def long_prompts(prompts: list[str], sequence_length: int) -> list[str]:
    """Each prompt made at least `sequence_length` tokens long (8 characters a token: twice what English takes),
    its number at both ends so that no two share a first or last block (the prefix cache would skip prefill)."""
    out = []
    for i, prompt in enumerate(prompts):
        words = [f"Request {i}."]
        while sum(map(len, words)) < 8 * sequence_length:
            words.append(PROMPTS[(i + len(words)) % len(PROMPTS)])
        out.append(" ".join(words) + f" Request {i}.")
    return out


async def exact_prompts(client: Any, url: str, prompts: list[str], sequence_length: int) -> list[list[int]]:
    """The first `sequence_length` token ids of each long prompt, from the server's own tokenizer (/tokenize)."""
    async def one(text: str) -> list[int]:
        resp = await client.post(f"{url.rstrip('/')}/tokenize", json={"inputs": text})
        if resp.status_code != 200:
            raise UsageError(f"--sequence-length needs the server's /tokenize: {resp.status_code} {resp.text[:200]}")
        ids = [int(t["id"]) for t in resp.json()]
        if len(ids) < sequence_length:
            raise UsageError(f"--sequence-length {sequence_length}: a prompt made only {len(ids)} tokens")
        return ids[:sequence_length]
    return list(await asyncio.gather(*(one(text) for text in long_prompts(prompts, sequence_length))))


def request_body(prompt: str | list[int], new_tokens: int, model: str, openai: bool,
                 truncate: int | None = None) -> tuple[str, dict[str, Any]]:
    """(path, body) of one greedy streaming request (a token-id prompt on /v1/completions; `truncate` keeps
    the last tokens of a /generate_stream prompt)."""
    if openai:
        return "/v1/completions", {"model": model or "tgi", "prompt": prompt, "max_tokens": new_tokens,
                                   "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    parameters = {"max_new_tokens": new_tokens, "do_sample": False, "details": True}
    if truncate is not None:
        parameters["truncate"] = truncate
    return "/generate_stream", {"inputs": prompt, "parameters": parameters}


def read_event(record: Record, event: Any, now: float, openai: bool = True) -> None:
    """Fold one stream event into `record`: a token, the usage or details, or an error."""
    if not isinstance(event, dict):
        record.error = f"unexpected event: {str(event)[:200]}"
        return
    if "error" in event:
        record.error = str(event["error"])[:300]
        return
    if not openai:
        record.token_times.append(now)
        details = event.get("details")
        if isinstance(details, dict):
            record.finish_reason = details.get("finish_reason")
            record.num_tokens = int(details.get("generated_tokens") or 0)
        return
    choices = event.get("choices")
    if choices and isinstance(choices, list) and isinstance(choices[0], dict):
        if choices[0].get("text"):
            record.token_times.append(now)
        record.finish_reason = choices[0].get("finish_reason") or record.finish_reason
    usage = event.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        record.num_tokens = usage["completion_tokens"]
        if isinstance(usage.get("prompt_tokens"), int):
            record.prompt_tokens = usage["prompt_tokens"]


async def one_request(client: Any, url: str, body: dict[str, Any], openai: bool = True) -> Record:
    record = Record(sent=time.perf_counter())
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            else:
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    try:
                        read_event(record, json.loads(data), time.perf_counter(), openai)
                    except ValueError:
                        record.error = f"not JSON: {data[:200]}"
    except Exception as exc:  # noqa: BLE001 - a failed request is counted, the load goes on
        record.error = f"{type(exc).__name__}: {exc}"
    record.end = time.perf_counter()
    if not record.num_tokens:
        record.num_tokens = len(record.token_times)
    return record


Watch = Callable[[list[Record], int], None]      # (the measured records finished so far, how many are sent)


async def run_load(url: str, headers: dict[str, str], model: str, opts: LoadOptions, transport: Any = None,
                   prompts: list[str] | None = None, watch: Watch | None = None) -> list[Record]:
    """`concurrency` closed-loop clients send the prompts (default: `num_requests` of PROMPTS) as greedy
    streaming requests to `url`; `warmup` requests go first and are not returned. `watch` sees the records
    after each measured request ends (a live view)."""
    import httpx

    total = opts.num_requests if opts.num_requests is not None else opts.runs * opts.concurrency
    todo: list[Any] = list(prompts if prompts is not None else make_prompts(total))
    warm: list[Any] = make_prompts(opts.warmup)
    records: list[Record] = []
    limits = httpx.Limits(max_connections=opts.concurrency, max_keepalive_connections=opts.concurrency)
    length = opts.sequence_length

    async def clients(client: httpx.AsyncClient, queue: list[Any], into: list[Record],
                      seen: Watch | None = None) -> None:
        deadline = time.perf_counter() + opts.max_duration_s if opts.max_duration_s else None
        total = len(queue)

        async def loop() -> None:
            while queue and (deadline is None or time.perf_counter() < deadline):
                path, body = request_body(queue.pop(0), opts.new_tokens, model, opts.openai,
                                          None if opts.openai else length)
                into.append(await one_request(client, f"{url.rstrip('/')}{path}", body, opts.openai))
                if seen is not None:
                    seen(into, total)
        await asyncio.gather(*(loop() for _ in range(opts.concurrency)))

    async with httpx.AsyncClient(headers=headers, timeout=opts.timeout_s, limits=limits,
                                 transport=transport) as client:
        if length is not None:          # before any timing: prompts of exactly `length` tokens
            if opts.openai:
                warm, todo = (await exact_prompts(client, url, warm + todo, length) if warm + todo else []), []
                warm, todo = warm[:opts.warmup], warm[opts.warmup:]
            else:
                warm, todo = long_prompts(warm, length), long_prompts(todo, length)
        if opts.warmup:
            await asyncio.wait_for(clients(client, warm, []), opts.timeout_s)
        await asyncio.wait_for(clients(client, todo, records, watch), opts.timeout_s)
    return records


def _stats(values: list[float]) -> dict[str, float | None]:
    return {f"p{q}": percentile(values, q) for q in QUANTILES} | {
        "mean": sum(values) / len(values) if values else None, "min": min(values, default=None),
        "max": max(values, default=None)}


def summarize(records: list[Record], concurrency: int) -> dict[str, Any]:
    """Every number of one run, times in seconds: percentiles (p50/p90/p99, mean, min, max) per metric."""
    ok = [r for r in records if r.error is None and r.token_times]
    failed = [r for r in records if r not in ok]
    ttft = [r.token_times[0] - r.sent for r in ok]
    tpot = [(r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1) for r in ok if len(r.token_times) > 1]
    itl = [b - a for r in ok for a, b in zip(r.token_times, r.token_times[1:])]
    e2e = [r.end - r.sent for r in ok]
    prefill = [r.prompt_tokens / (r.token_times[0] - r.sent) for r in ok
               if r.prompt_tokens and r.token_times[0] > r.sent]
    decode = [1 / t for t in tpot if t > 0]
    span = (max(r.end for r in records) - min(r.sent for r in records)) if records else 0.0
    tokens = sum(r.num_tokens for r in ok)
    reasons: dict[str, int] = {}
    for r in ok:
        reasons[str(r.finish_reason)] = reasons.get(str(r.finish_reason), 0) + 1
    return {"concurrency": concurrency, "requests": len(records), "completed": len(ok), "failed": len(failed),
            "errors": sorted({r.error or "no tokens" for r in failed})[:5], "generated_tokens": tokens,
            "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok), "finish_reasons": reasons,
            "seconds": span, "requests_per_s": len(ok) / span if span else 0.0,
            "tokens_per_s": tokens / span if span else 0.0,
            "ttft_s": _stats(ttft), "tpot_s": _stats(tpot), "itl_s": _stats(itl), "e2e_s": _stats(e2e),
            "prefill_tok_s": _stats(prefill), "decode_tok_s": _stats(decode)}


def _cell(value: float | None, scale: float = 1.0) -> str:
    return "-" if value is None else f"{value * scale:.1f}"


def tables(runs: list[dict[str, Any]]) -> str:
    """The prefill and decode tables (text-generation-benchmark's layout): a row per concurrency and metric,
    a column per statistic; then each run's throughput."""
    columns = ("mean", "min", "max", "p50", "p90", "p99")
    head = f"| {'step':<8}| {'clients':>7} | {'metric':<18}|" + "".join(f" {c:>9} |" for c in columns)
    rule = "|" + "|".join("-" * (len(part)) for part in head.split("|")[1:-1]) + "|"
    lines = []
    for step, metrics in (("prefill", (("ttft_s", "TTFT ms", 1e3), ("prefill_tok_s", "prompt tok/s", 1.0))),
                          ("decode", (("tpot_s", "TPOT ms", 1e3), ("itl_s", "ITL ms", 1e3),
                                      ("decode_tok_s", "tok/s per stream", 1.0)))):
        lines += ["", f"{step.capitalize()}", head, rule]
        for run in runs:
            for key, title, scale in metrics:
                row = run[key]
                lines.append(f"| {step:<8}| {run['concurrency']:>7} | {title:<18}|"
                             + "".join(f" {_cell(row[c], scale):>9} |" for c in columns))
    lines += ["", "Throughput"]
    for run in runs:
        line = (f"{run['completed']}/{run['requests']} requests at concurrency {run['concurrency']} in "
                f"{run['seconds']:.1f} s: {run['requests_per_s']:.2f} req/s, {run['tokens_per_s']:.1f} generated tok/s, "
                f"E2E p50 {_cell(run['e2e_s']['p50'], 1e3)} ms")
        if run["failed"]:
            line += f", {run['failed']} failed ({'; '.join(run['errors'])})"
        lines.append(line)
    return "\n".join(lines[1:])


def bench(cluster: Any, target: str | None, opts: LoadOptions, *, concurrencies: list[int] | None = None,
          timeout: float = 600, progress: Callable[[str], None] = lambda m: None,
          watch: Callable[[int, list[Record], int], None] | None = None) -> dict[str, Any]:
    """Load the target's server once it is READY, once per concurrency (default: opts.concurrency); every run's
    summary under `runs`, also saved beside the job's log (on the cluster). `watch(level, records, sent)` sees
    each level's records as they end."""
    from dataclasses import replace
    from pathlib import Path

    from tgi_hpc.workflows.access import connect

    levels = concurrencies or [opts.concurrency]
    if min(levels) < 1 or opts.new_tokens < 1 or opts.warmup < 0 or (
            opts.num_requests is not None and opts.num_requests < 1) or opts.runs < 1 or (
            opts.sequence_length is not None and opts.sequence_length < 1):
        raise UsageError("--concurrency, --requests, --runs, --sequence-length and --new-tokens must be >= 1, "
                         "--warmup >= 0")
    runs = []
    with connect(cluster, target, timeout=timeout, progress=progress) as access:
        for level in levels:
            run_opts = replace(opts, concurrency=level)
            progress(f"benchmarking {access.url} ({access.via}): {level} clients, "
                     + (f"{opts.sequence_length} prompt tokens and " if opts.sequence_length else "")
                     + f"{opts.new_tokens} new tokens each"
                     + (f", {opts.warmup} warm-up requests first" if opts.warmup else ""))
            seen = None if watch is None else (lambda records, sent, level=level: watch(level, records, sent))
            records = asyncio.run(run_load(access.url, access.headers, access.model, run_opts, watch=seen))
            runs.append(summarize(records, level))
    result: dict[str, Any] = {"target": access.job_id, "url": access.url, "new_tokens": opts.new_tokens,
                              "sequence_length": opts.sequence_length, "runs": runs}
    if cluster.is_local:
        saved = Path(cluster.job_dir) / f"{access.job_id}.bench-{time.strftime('%Y%m%d-%H%M%S')}.json"
        saved.write_text(json.dumps(result, indent=2))
        result["saved"] = str(saved)
    return result
