"""A huge grammar does not stall other clients (issue 27, failure path 4): while one client streams tokens from
tiny-llama, another posts a 2 MB JSON schema; it gets a 422 naming the limit it hit (size, or compile time when
the size limit is raised), and the streaming client's largest gap between tokens grows by less than 100 ms."""
import json
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("llguidance")

MAX_EXTRA_GAP_S = 0.1


def big_schema(min_bytes=2_000_000):
    """An object schema of about 2 MB: 16,000 described string properties (jsonschema checks it for a minute)."""
    props = {f"field_{i}": {"type": "string", "description": "x" * 60, "maxLength": 20} for i in range(16_000)}
    schema = {"type": "object", "properties": props, "required": list(props)[:50]}
    assert len(json.dumps(schema)) >= min_bytes
    return schema


class Streamer(threading.Thread):
    """Streams greedy tokens, one request after another, recording the gaps between tokens within a request."""

    def __init__(self, url):
        super().__init__(daemon=True)
        self.url, self.stop, self.gaps, self.error = url, threading.Event(), [], None

    def run(self):
        body = {"inputs": "Count to one thousand: 1, 2, 3", "parameters": {"max_new_tokens": 480}}
        try:
            with httpx.Client(timeout=60) as client:
                while not self.stop.is_set():
                    last = None
                    with client.stream("POST", f"{self.url}/generate_stream", json=body) as response:
                        for line in response.iter_lines():
                            if not line.startswith("data:") or self.stop.is_set():
                                continue
                            now = time.monotonic()
                            if last is not None:    # not the first token: its wait is the prefill's
                                self.gaps.append((now, now - last))
                            last = now
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    def max_gap(self, start, end):
        return max((gap for at, gap in self.gaps if start <= at <= end), default=None)


@pytest.mark.parametrize("flags, limit", [([], "--max-grammar-bytes"),
                                          (["--max-grammar-bytes", "4MiB", "--grammar-timeout", "3"],
                                           "--grammar-timeout")], ids=["size", "time"])
def test_a_2mb_schema_does_not_delay_another_clients_tokens(model_path, tmp_path, flags, limit):
    from test_clients import start_server, stop_server

    proc, url, _ = start_server(model_path("tiny-llama"), tmp_path, "--device", "cpu", "--cpu-threads", "1",
                                "--max-total-tokens", "512", *flags)
    streamer = Streamer(url)
    payload = json.dumps({"inputs": "Hello", "parameters": {
        "max_new_tokens": 4, "grammar": {"type": "json", "value": big_schema()}}})
    try:
        streamer.start()
        while len(streamer.gaps) < 20:
            assert streamer.error is None and streamer.is_alive(), streamer.error
            time.sleep(0.05)
        baseline_start = time.monotonic()
        time.sleep(3.0)
        sent = time.monotonic()
        response = httpx.post(f"{url}/generate", content=payload, headers={"Content-Type": "application/json"},
                              timeout=120)
        answered = time.monotonic()
        time.sleep(0.3)
        streamer.stop.set()
        streamer.join(60)
        assert streamer.error is None, streamer.error
        assert response.status_code == 422, response.text
        body = response.json()
        assert body["error_type"] == "validation" and limit in body["error"], body
        assert answered - sent < 30
        baseline, during = streamer.max_gap(baseline_start, sent), streamer.max_gap(sent, answered + 0.3)
        assert baseline is not None and during is not None, "the stream must run through both windows"
        assert during < baseline + MAX_EXTRA_GAP_S, f"largest gap {during * 1000:.0f} ms with the schema, " \
                                                   f"{baseline * 1000:.0f} ms without"
        # refused once, refused again at once: the verdict is cached, not recomputed
        again = time.monotonic()
        assert httpx.post(f"{url}/generate", content=payload, headers={"Content-Type": "application/json"},
                          timeout=120).status_code == 422
        assert time.monotonic() - again < 2.0
    finally:
        streamer.stop.set()
        stop_server(proc)


def test_a_small_schema_still_constrains_the_output(model_path, tmp_path):
    """The off-loop path compiles and applies an ordinary schema (its spec and matcher come from the caches)."""
    from test_clients import start_server, stop_server

    proc, url, _ = start_server(model_path("tiny-llama"), tmp_path, "--device", "cpu", "--cpu-threads", "1",
                                "--max-total-tokens", "512")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    try:
        body = {"inputs": "Answer:", "parameters": {"max_new_tokens": 30, "grammar": {"type": "json", "value": schema}}}
        response = httpx.post(f"{url}/generate", json=body, timeout=60)
        assert response.status_code == 200, response.text
        assert json.loads(response.json()["generated_text"]) in ({"ok": True}, {"ok": False})
    finally:
        stop_server(proc)


def test_the_worker_builds_each_grammar_of_a_raw_body_and_stops_at_one_too_large(monkeypatch):
    from engine.structured import spec
    from engine.structured.offload import build_request

    body = {"inputs": "x", "parameters": {"grammar": {"type": "regex", "value": "a+"}}}
    ((kind, text, entry),) = build_request(json.dumps(body).encode())
    assert (kind, text, entry.kind) == ("regex", "a+", "regex")
    body = {"inputs": "x", "parameters": {"grammar": {"type": "json", "value": {"type": "objekt"}}}}
    ((_, _, error),) = build_request(json.dumps(body).encode())
    assert error.startswith(f"`{spec.FIELD}` is not a valid JSON schema")   # the field is filled in per request
    monkeypatch.setattr(spec.LIMITS, "max_bytes", 1000)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "g", "parameters": {"type": "object", "description": "x" * 2000}}}]
    body = {"messages": [], "tools": tools, "response_format": {"type": "json_schema",
                                                                 "json_schema": {"name": "n", "schema": {}}}}
    ((kind, field, size),) = build_request(json.dumps(body).encode())   # the schemas before it are not returned
    assert (kind, field) == ("size", "tools[1].function.parameters") and size > 2000
    del body["tools"][1]
    assert [(kind, entry.kind) for kind, _, entry in build_request(json.dumps(body).encode())] == [("json", "json")] * 2
    assert build_request(b"not json") == []
