"""tgi_hpc.workflows.bench: the load generator against an in-process fake server (timed SSE streams), and the
prefill and decode tables from records of known times."""
from __future__ import annotations

import asyncio
import io
import json

import httpx
import pytest

from tgi_hpc.workflows.bench import LoadOptions, Record, make_prompts, percentile, run_load, summarize, tables


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
            if kind == "tgi":
                for chunk in sse(*({"token": {"id": i, "text": f"t{i}"}} for i in range(2)),
                                 {"token": {"id": 2, "text": "!"}, "details": {"finish_reason": "eos_token",
                                                                              "generated_tokens": 3}}):
                    yield chunk
                return
            for i in range(4):
                await asyncio.sleep(gap_s)
                yield sse({"choices": [{"index": 0, "text": f"t{i}"}]})[0]
            for chunk in sse({"choices": [], "usage": {"completion_tokens": 4, "prompt_tokens": 7}}, b"[DONE]"):
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


def test_warmup_requests_go_first_and_are_not_counted():
    transport, state = fake_server(lambda i: "ok", gap_s=0.0)
    opts = LoadOptions(concurrency=2, num_requests=3, new_tokens=4, warmup=2)
    records = asyncio.run(run_load("http://x", {}, "m", opts, transport))
    assert len(state["bodies"]) == 5 and len(records) == 3
    s = summarize(records, 2)
    assert (s["completed"], s["prompt_tokens"], s["generated_tokens"]) == (3, 21, 12)
    assert s["prefill_tok_s"]["p50"] > 0 and s["decode_tok_s"]["p50"] > 0


def test_tgi_generate_stream_counts_tokens_from_its_details():
    transport, state = fake_server(lambda i: "tgi", gap_s=0.0)
    opts = LoadOptions(concurrency=1, num_requests=2, new_tokens=3, openai=False)
    records = asyncio.run(run_load("http://x", {}, "m", opts, transport))
    assert [b["parameters"] for b, _ in state["bodies"]] == [{"max_new_tokens": 3, "do_sample": False,
                                                              "details": True}] * 2
    assert [(r.num_tokens, r.finish_reason, len(r.token_times), r.error) for r in records] == [(3, "eos_token", 3,
                                                                                               None)] * 2


def test_prefill_and_decode_tables_by_percentile_from_known_times():
    fast = Record(sent=0.0, token_times=[0.1, 0.2, 0.3], num_tokens=3, prompt_tokens=10, end=0.3)
    slow = Record(sent=0.0, token_times=[0.5, 0.9], num_tokens=2, prompt_tokens=20, end=1.0)
    failed = Record(sent=0.0, end=0.05, error="HTTP 503: b'overloaded'")
    run = summarize([fast, slow, failed], 2)
    assert run["ttft_s"]["min"] == 0.1 and run["ttft_s"]["max"] == 0.5 and run["ttft_s"]["mean"] == pytest.approx(0.3)
    assert run["prefill_tok_s"]["p50"] == pytest.approx(70.0)            # 10/0.1 and 20/0.5
    assert run["tpot_s"]["p50"] == pytest.approx(0.25)                   # 0.1 and 0.4
    assert run["decode_tok_s"]["max"] == pytest.approx(10.0) and run["decode_tok_s"]["min"] == pytest.approx(2.5)
    text = tables([run, summarize([fast], 1)])
    prefill, decode = text.index("Prefill"), text.index("Decode")
    assert prefill < decode < text.index("Throughput")
    rows = {tuple(c.strip() for c in line.strip("|").split("|")[:3]): [c.strip() for c in line.strip("|").split("|")[3:]]
            for line in text.splitlines() if line.startswith("| prefill") or line.startswith("| decode")}
    assert rows[("prefill", "2", "TTFT ms")] == ["300.0", "100.0", "500.0", "300.0", "460.0", "496.0"]
    assert rows[("prefill", "1", "prompt tok/s")] == ["100.0"] * 6
    assert rows[("decode", "2", "TPOT ms")][:3] == ["250.0", "100.0", "400.0"]
    assert rows[("decode", "1", "tok/s per stream")] == ["10.0"] * 6
    assert "2/3 requests at concurrency 2 in 1.0 s" in text and "1 failed (HTTP 503: b'overloaded')" in text


def test_prompts_are_distinct_however_many_are_asked():
    assert len(set(make_prompts(50))) == 50 and make_prompts(0) == []


def with_tokenize(transport, status=200):
    """The fake server plus a /tokenize that makes a token of each word (ids from the word and its place)."""
    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/tokenize":
            if status != 200:
                return httpx.Response(status, json={"error": "not here", "error_type": "not_found"})
            words = json.loads(request.content)["inputs"].split()
            return httpx.Response(200, json=[{"id": 3 * i + len(w), "text": w, "start": 0, "stop": 0}
                                             for i, w in enumerate(words)])
        return await transport.handler(request)
    return httpx.MockTransport(handler)


def test_sequence_length_sends_prompts_of_exactly_that_many_distinct_tokens():
    from tgi_hpc.errors import UsageError

    transport, state = fake_server(lambda i: "ok", gap_s=0.0)
    opts = LoadOptions(concurrency=2, num_requests=20, new_tokens=4, warmup=1, sequence_length=300)
    records = asyncio.run(run_load("http://x", {}, "m", opts, with_tokenize(transport)))
    prompts = [b["prompt"] for b, _ in state["bodies"]]
    assert len(records) == 20 and len(prompts) == 21 and all(len(p) == 300 for p in prompts)
    assert all(isinstance(t, int) for p in prompts for t in p)
    assert len({tuple(p[:16]) for p in prompts}) == 21       # no two share a first KV block

    transport, state = fake_server(lambda i: "tgi", gap_s=0.0)
    opts = LoadOptions(concurrency=1, num_requests=3, new_tokens=3, openai=False, sequence_length=50)
    asyncio.run(run_load("http://x", {}, "m", opts, transport))
    bodies = [b for b, _ in state["bodies"]]
    assert [b["parameters"]["truncate"] for b in bodies] == [50] * 3          # TGI keeps the last 50 tokens
    assert all(len(b["inputs"].split()) >= 50 for b in bodies)
    assert len({tuple(b["inputs"].split()[-16:]) for b in bodies}) == 3

    transport, _ = fake_server(lambda i: "ok", gap_s=0.0)
    with pytest.raises(UsageError, match="needs the server's /tokenize: 404"):
        asyncio.run(run_load("http://x", {}, "m", LoadOptions(num_requests=1, sequence_length=8),
                             with_tokenize(transport, status=404)))


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_watch_sees_each_measured_request_end_and_never_the_warmup():
    transport, _ = fake_server(lambda i: "error" if i == 3 else "ok", gap_s=0.0)
    seen = []
    opts = LoadOptions(concurrency=2, num_requests=5, new_tokens=2, warmup=2)
    records = asyncio.run(run_load("http://x", {}, "m", opts, transport,
                                   watch=lambda done, sent: seen.append((len(done), sent))))
    assert seen == [(n, 5) for n in range(1, 6)] and len(records) == 5


def test_live_view_draws_a_row_per_level_on_a_terminal_and_nothing_elsewhere():
    from tgi_hpc.cli._app import App
    from tgi_hpc.cli.bench import LiveView

    done = [Record(sent=0.0, token_times=[0.1, 0.2, 0.3], num_tokens=3, end=0.3),
            Record(sent=0.0, end=0.05, error="HTTP 503")]
    tty = Tty()
    with LiveView(App(), stream=tty, every_s=0.0) as view:
        view(4, done, 10)
        view(8, done[:1], 1)
    drawn = tty.getvalue()
    assert "TTFT p50 ms" in drawn and "2/10" in drawn and "1/1" in drawn and "100.0" in drawn and "10.0" in drawn
    for app, stream in ((App(json_output=True), Tty()), (App(verbosity=-1), Tty()), (App(), io.StringIO())):
        with LiveView(app, stream=stream) as view:
            view(4, done, 10)
        assert not view.on and stream.getvalue() == ""
