"""`tgi-hpc bench`: load a running server (job or service) with streaming clients; TTFT, TPOT, ITL, E2E
percentiles and throughput. The load generator of scripts/bench_http.py, reaching the target the usual way
(tgi_hpc.workflows.access: direct on the cluster, a tunnel from a laptop).

Definitions (per request; percentiles over requests, ITL over every gap between two tokens):
TTFT = first token - request sent; TPOT = (end - first token) / (tokens - 1);
ITL = time between consecutive streamed tokens; E2E = last event - request sent.
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

PROMPTS = [
    "Explain in detail how a compiler turns source code into machine code.",
    "Describe a walk through a busy market in a coastal town, with all the sounds and smells.",
    "List the steps to bake sourdough bread at home and explain why each step matters.",
    "Once upon a time, in a kingdom far away, there lived a young inventor who",
    "Tell the story of a cat that wanted to become a sailor.",
    "Slurm is a workload manager used on many supercomputers. To submit a job,",
    "The first computers filled whole rooms, and the engineers who ran them",
    "Describe how photosynthesis works, from sunlight to sugar, for a curious teenager.",
]


@dataclass
class LoadOptions:
    concurrency: int = 8
    num_requests: int | None = None     # default: 4 waves of `concurrency`
    new_tokens: int = 64
    timeout_s: float = 600.0            # the whole run


@dataclass(slots=True)
class Record:
    sent: float
    token_times: list[float] = field(default_factory=list)
    num_tokens: int = 0
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


def read_event(record: Record, event: Any, now: float) -> None:
    """Fold one /v1/completions stream event into `record`: a token, the usage, or an error."""
    if not isinstance(event, dict):
        record.error = f"unexpected event: {str(event)[:200]}"
        return
    if "error" in event:
        record.error = str(event["error"])[:300]
        return
    choices = event.get("choices")
    if choices and isinstance(choices, list) and isinstance(choices[0], dict) and choices[0].get("text"):
        record.token_times.append(now)
    usage = event.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        record.num_tokens = usage["completion_tokens"]


async def _one(client: Any, url: str, body: dict) -> Record:
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
                        read_event(record, json.loads(data), time.perf_counter())
                    except ValueError:
                        record.error = f"not JSON: {data[:200]}"
    except Exception as exc:  # noqa: BLE001 - a failed request is counted, the load goes on
        record.error = f"{type(exc).__name__}: {exc}"
    record.end = time.perf_counter()
    if not record.num_tokens:
        record.num_tokens = len(record.token_times)
    return record


async def run_load(url: str, headers: dict[str, str], model: str, opts: LoadOptions,
                   transport: Any = None) -> list[Record]:
    """`concurrency` closed-loop clients send `num_requests` greedy streaming completions to `url`."""
    import httpx

    total = opts.num_requests if opts.num_requests is not None else 4 * opts.concurrency
    todo = list(range(total))
    records: list[Record] = []

    async def client_loop(client: httpx.AsyncClient) -> None:
        while todo:
            i = todo.pop()
            body = {"model": model or "tgi", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": opts.new_tokens,
                    "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
            records.append(await _one(client, f"{url.rstrip('/')}/v1/completions", body))

    limits = httpx.Limits(max_connections=opts.concurrency)
    async with httpx.AsyncClient(headers=headers, timeout=opts.timeout_s, limits=limits,
                                 transport=transport) as client:
        await asyncio.wait_for(asyncio.gather(*(client_loop(client) for _ in range(opts.concurrency))),
                               opts.timeout_s)
    return records


def summarize(records: list[Record], concurrency: int) -> dict[str, Any]:
    ok = [r for r in records if r.error is None and r.token_times]
    failed = [r for r in records if r not in ok]
    ttft = [r.token_times[0] - r.sent for r in ok]
    tpot = [(r.end - r.token_times[0]) / (r.num_tokens - 1) for r in ok if r.num_tokens > 1]
    itl = [b - a for r in ok for a, b in zip(r.token_times, r.token_times[1:])]
    e2e = [r.end - r.sent for r in ok]
    span = (max(r.end for r in records) - min(r.sent for r in records)) if records else 0.0
    tokens = sum(r.num_tokens for r in ok)
    stats = {name: {f"p{q}": percentile(values, q) for q in (50, 90, 99)}
             | {"mean": sum(values) / len(values) if values else None}
             for name, values in (("ttft_s", ttft), ("tpot_s", tpot), ("itl_s", itl), ("e2e_s", e2e))}
    return {"concurrency": concurrency, "requests": len(records), "completed": len(ok), "failed": len(failed),
            "errors": sorted({r.error or "no tokens" for r in failed})[:5], "generated_tokens": tokens,
            "seconds": span, "requests_per_s": len(ok) / span if span else 0.0,
            "tokens_per_s": tokens / span if span else 0.0, **stats}


def bench(cluster: Any, target: str | None, opts: LoadOptions, *, timeout: float = 600,
          progress: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    """Load the target's server once it is READY; the summary, also saved beside the job's log (on the cluster)."""
    from pathlib import Path

    from tgi_hpc.workflows.access import connect

    if opts.concurrency < 1 or opts.new_tokens < 1 or (opts.num_requests is not None and opts.num_requests < 1):
        raise UsageError("--concurrency, --requests and --new-tokens must be >= 1")
    with connect(cluster, target, timeout=timeout, progress=progress) as access:
        progress(f"benchmarking {access.url} ({access.via}): {opts.concurrency} clients, {opts.new_tokens} tokens each")
        records = asyncio.run(run_load(access.url, access.headers, access.model, opts))
        summary = {"target": access.job_id, "url": access.url, **summarize(records, opts.concurrency)}
    if cluster.is_local:
        saved = Path(cluster.job_dir) / f"{access.job_id}.bench-{time.strftime('%Y%m%d-%H%M%S')}.json"
        saved.write_text(json.dumps(summary, indent=2))
        summary["saved"] = str(saved)
    return summary
