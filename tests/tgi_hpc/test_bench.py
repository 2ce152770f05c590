"""tgi_hpc.workflows.bench: the load generator against an in-process fake server (timed SSE streams)."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tgi_hpc.workflows.bench import LoadOptions, percentile, run_load, summarize


def sse(*events) -> list[bytes]:
    return [b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n" for e in events]


def fake_server(behaviour, gap_s=0.01):
    state = {"bodies": []}

    async def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        state["bodies"].append((body, request.headers.get("authorization")))
        kind = behaviour(len(state["bodies"]) - 1)
        if kind == "500":
            return httpx.Response(500, content=b'{"error": "overloaded"}')

        async def stream():
            if kind == "garbage":
                yield b"data: {not json\n\n"
                return
            if kind == "error":
                yield sse({"error": "boom", "error_type": "generation"})[0]
                return
            for i in range(4):
                await asyncio.sleep(gap_s)
                yield sse({"choices": [{"index": 0, "text": f"t{i}"}]})[0]
            for chunk in sse({"choices": [], "usage": {"completion_tokens": 4}}, b"[DONE]"):
                yield chunk
        return httpx.Response(200, content=stream(), headers={"content-type": "text/event-stream"})
    return httpx.MockTransport(handler), state


def test_latencies_and_throughput_from_timed_streams():
    transport, state = fake_server(lambda i: "ok")
    opts = LoadOptions(concurrency=3, num_requests=9, new_tokens=4)
    records = asyncio.run(run_load("http://node:1234/", {"Authorization": "Bearer k"}, "m", opts, transport))
    s = summarize(records, 3)
    assert (s["requests"], s["completed"], s["failed"], s["generated_tokens"]) == (9, 9, 0, 36)
    overlap = max(sum(1 for o in records if o.sent <= r.sent < o.end) for r in records)
    assert overlap == 3                                   # three clients, never more requests in flight
    assert all(b["max_tokens"] == 4 and b["stream"] and b["temperature"] == 0 and auth == "Bearer k"
               for b, auth in state["bodies"])
    assert 0.009 <= s["ttft_s"]["p50"] < 0.5 and 0.009 <= s["itl_s"]["p50"] < 0.5
    assert s["tpot_s"]["p50"] == pytest.approx(s["itl_s"]["mean"], rel=0.5)
    assert s["e2e_s"]["p99"] >= s["e2e_s"]["p50"] >= s["ttft_s"]["p50"]
    assert s["tokens_per_s"] == pytest.approx(36 / s["seconds"]) and s["requests_per_s"] > 0


def test_failures_are_counted_with_their_reason_and_the_load_goes_on():
    kinds = ["ok", "500", "garbage", "error", "ok", "ok"]
    transport, _ = fake_server(lambda i: kinds[i], gap_s=0.0)
    records = asyncio.run(run_load("http://x", {}, "", LoadOptions(concurrency=1, num_requests=6), transport))
    s = summarize(records, 1)
    assert (s["completed"], s["failed"]) == (3, 3)
    assert any("HTTP 500" in e for e in s["errors"]) and any("not JSON" in e for e in s["errors"])
    assert any("boom" in e for e in s["errors"])


def test_percentiles_interpolate_and_nothing_gives_none():
    assert percentile([4, 1, 3, 2], 50) == 2.5 and percentile([1, 2, 3, 4], 100) == 4
    assert percentile([], 50) is None
    empty = summarize([], 4)
    assert empty["completed"] == 0 and empty["ttft_s"]["p50"] is None and empty["tokens_per_s"] == 0.0
