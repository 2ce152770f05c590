"""engine.server over a FakeEngine that honours LLMEngine's contract: routes, SSE framing, errors, metrics,
API key, health, admission and client disconnect (real uvicorn)."""
from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace

import httpx
import pytest

pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")

from starlette.testclient import TestClient  # noqa: E402

from engine.async_engine import AsyncEngine, RequestFailedError  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.outputs import RequestOutput, TokenInfo  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.server.app import build_app  # noqa: E402

SCRIPT = "the quick brown fox jumps over the lazy dog "
BOS, EOS, OFFSET = 1, 2, 10  # token id = ord(char) + OFFSET


class CharTokenizer:
    """One token per character, BOS prepended; enough of the HF tokenizer API for the server."""

    bos_token_id = BOS
    chat_template = "chatml"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if text == "BOOM":
            raise RuntimeError("tokenizer bug with a secret path /home/x")
        return ([BOS] if add_special_tokens else []) + [ord(c) + OFFSET for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(i - OFFSET) for i in ids if i >= OFFSET)

    def __call__(self, text: str, add_special_tokens: bool = True, return_offsets_mapping: bool = False) -> dict:
        ids = self.encode(text, add_special_tokens)
        offsets = ([(0, 0)] if add_special_tokens else []) + [(i, i + 1) for i in range(len(text))]
        return {"input_ids": ids, "offset_mapping": offsets}

    def apply_chat_template(self, messages: list[dict], tokenize: bool = False, add_generation_prompt: bool = False):
        if messages[0]["role"] == "bad":
            raise ValueError("roles must alternate")
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


@dataclass
class _Req:
    prompt: list[int]
    params: SamplingParams
    variant: int = 0
    generated: list[int] = field(default_factory=list)


class FakeEngine:
    """Deterministic LLMEngine stand-in: emits SCRIPT one character per step; holds KV blocks per token.

    Prompts containing FAIL get a per-request error, ABORT ends early, EOS stops after 3 tokens, and VARY
    shifts each new request's text by one character with a lower logprob (to tell best_of copies apart).
    `crash = True` makes step() raise.
    """

    block_size = 4
    num_total_blocks = 256
    vocab_size = 1000

    def __init__(self, step_delay_s: float = 0.0) -> None:
        self.tokenizer = CharTokenizer()
        self.eos_token_ids = [EOS]
        self.max_input_tokens, self.max_total_tokens = 200, 256
        self.max_batch_prefill_tokens, self.max_batch_total_tokens = 256, 1024
        self.step_delay_s = step_delay_s
        self.crash = False
        self.aborted: list[str] = []
        self.seen: dict[str, SamplingParams] = {}
        self._reqs: dict[str, _Req] = {}
        self._lock = threading.Lock()

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        with self._lock:
            self._reqs[request_id] = _Req(list(prompt_token_ids), params, variant=len(self.seen))
            self.seen[request_id] = params

    def abort(self, request_id: str) -> None:
        with self._lock:
            if self._reqs.pop(request_id, None) is not None:
                self.aborted.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._reqs)

    def stats(self) -> SimpleNamespace:
        with self._lock:
            used = sum(-(-(len(r.prompt) + len(r.generated)) // self.block_size) for r in self._reqs.values())
            return SimpleNamespace(num_waiting=0, num_running=len(self._reqs), num_free_blocks=self.num_total_blocks - used,
                                   num_total_blocks=self.num_total_blocks, block_size=self.block_size, batch_size=len(self._reqs),
                                   attention_backend="fake")

    def close(self) -> None:
        pass

    def step(self) -> list[RequestOutput]:
        if self.crash:
            raise RuntimeError("CUDA error: device-side assert triggered")
        time.sleep(self.step_delay_s)
        with self._lock:
            outputs = [self._advance(rid, req) for rid, req in list(self._reqs.items())]
            for out in outputs:
                if out.finished:
                    del self._reqs[out.request_id]
        return outputs

    def _advance(self, rid: str, req: _Req) -> RequestOutput:
        prompt_text = self.tokenizer.decode(req.prompt)
        p = req.params
        if "FAIL" in prompt_text:
            return RequestOutput(rid, [], "", finished=True, error="CUDA out of memory")
        n = len(req.generated)
        if "EOS" in prompt_text and n == 3:
            token_id, text = EOS, ""
        else:
            variant = req.variant if "VARY" in prompt_text else 0
            char = SCRIPT[(n + variant) % len(SCRIPT)]
            token_id, text = ord(char) + OFFSET, char
        req.generated.append(token_id)
        top = [TokenInfo(token_id + k, chr(token_id + k - OFFSET), -0.5 * (k + 1), False) for k in range(p.top_n_tokens)]
        logprob = -0.25 * (1 + (req.variant % 7 if "VARY" in prompt_text else 0))
        token = TokenInfo(token_id, text, logprob, token_id == EOS, top)
        gen_text = self.tokenizer.decode(req.generated)
        finish, stop_text = None, ""
        if token_id == EOS:
            finish = "eos_token"
        elif any(s in gen_text for s in p.stop):
            finish = "stop_sequence"
            cut = min(gen_text.find(s) for s in p.stop if s in gen_text)
            gen_text, stop_text = gen_text[:cut], gen_text[cut:]
        elif "ABORT" in prompt_text and n == 1:
            finish = "aborted"
        elif len(req.generated) >= p.max_new_tokens:
            finish = "length"
        prefill = None
        if n == 0 and p.prefill_logprobs:
            prefill = [TokenInfo(t, self.tokenizer.decode([t]), None if i == 0 else -1.0, t == BOS)
                       for i, t in enumerate(req.prompt)]
        return RequestOutput(rid, [token], text, finished=finish is not None, finish_reason=finish,
                             generated_text=gen_text if finish else None, stop_text=stop_text,
                             num_prompt_tokens=len(req.prompt),
                             num_generated_tokens=len(req.generated), seed=p.seed if p.seed is not None else 7,
                             prefill_tokens=prefill)


def make_app(fake: FakeEngine | None = None, **config_kw):
    fake = fake or FakeEngine()
    engine = AsyncEngine(fake).start()
    config = EngineConfig(model_id="/models/fake", served_model_name="fake-model", **config_kw)
    return build_app(engine, config), engine, fake


@pytest.fixture(scope="module")
def served():
    app, engine, fake = make_app()
    with TestClient(app) as client:
        yield client, fake
    engine.close()


@pytest.fixture
def client(served):
    return served[0]


@contextmanager
def uvicorn_server(app) -> Iterator[str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)


def sse_events(body: str) -> list[str]:
    assert body.endswith("\n\n"), body[-50:]
    return [chunk for chunk in body.split("\n\n") if chunk]


# --- /generate ----------------------------------------------------------------------------------

def test_generate_text_details_and_headers(client):
    r = client.post("/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 5, "details": True,
                                                                      "decoder_input_details": True, "seed": 3}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["generated_text"] == "the q"
    d = body["details"]
    assert (d["finish_reason"], d["generated_tokens"], d["seed"]) == ("length", 5, 3)
    assert [t["text"] for t in d["tokens"]] == list("the q")
    assert d["tokens"][0] == {"id": ord("t") + OFFSET, "text": "t", "logprob": -0.25, "special": False}
    assert [t["id"] for t in d["prefill"]] == [BOS, ord("h") + OFFSET, ord("i") + OFFSET]
    assert "top_tokens" not in d and "best_of_sequences" not in d
    h = r.headers
    assert (h["x-prompt-tokens"], h["x-generated-tokens"], h["x-compute-characters"]) == ("3", "5", "2")
    for name in ("x-compute-type", "x-compute-time", "x-total-time", "x-validation-time", "x-queue-time",
                 "x-inference-time", "x-time-per-token"):
        assert name in h


def test_generate_without_details_has_no_details_key(client):
    body = client.post("/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 2}}).json()
    assert body == {"generated_text": "th"}


def test_parameters_reach_the_engine(served):
    client, fake = served
    before = set(fake.seen)
    client.post("/generate", json={"inputs": "hi", "parameters": {
        "max_new_tokens": 3, "temperature": 0.5, "top_k": 5, "top_p": 0.9, "typical_p": 0.8,
        "repetition_penalty": 1.2, "frequency_penalty": 0.3, "seed": 9, "stop": ["zz"], "top_n_tokens": 2}})
    (rid,) = set(fake.seen) - before
    p = fake.seen[rid]
    assert (p.do_sample, p.temperature, p.top_k, p.top_p, p.typical_p) == (True, 0.5, 5, 0.9, 0.8)
    assert (p.repetition_penalty, p.frequency_penalty, p.seed, p.stop, p.top_n_tokens) == (1.2, 0.3, 9, ["zz"], 2)
    assert p.max_new_tokens == 3


def test_greedy_when_only_do_sample_false(served):
    client, fake = served
    before = set(fake.seen)
    client.post("/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 1, "do_sample": False}})
    (rid,) = set(fake.seen) - before
    assert fake.seen[rid].do_sample is False


def test_default_max_new_tokens_fills_max_total_tokens(served):
    client, fake = served
    before = set(fake.seen)
    client.post("/generate", json={"inputs": "abc", "parameters": {"stop": ["brown"]}})
    (rid,) = set(fake.seen) - before
    assert fake.seen[rid].max_new_tokens == 256 - 4


def test_stop_sequence_and_eos(client):
    body = client.post("/generate", json={"inputs": "x", "parameters": {"stop": ["quick"], "details": True}}).json()
    assert body["generated_text"] == "the quick"   # TGI keeps the stop sequence in generated_text
    assert body["details"]["finish_reason"] == "stop_sequence"
    body = client.post("/generate", json={"inputs": "EOS", "parameters": {"details": True}}).json()
    assert body["details"]["finish_reason"] == "eos_token"
    assert body["details"]["tokens"][-1]["special"] is True


def test_return_full_text_and_truncate(client):
    body = client.post("/generate", json={"inputs": "hello", "parameters": {"max_new_tokens": 2,
                                                                            "return_full_text": True}}).json()
    assert body["generated_text"] == "helloth"
    r = client.post("/generate", json={"inputs": "y" * 300, "parameters": {"max_new_tokens": 2, "truncate": 10}})
    assert r.status_code == 200 and r.headers["x-prompt-tokens"] == "10"


def test_top_n_tokens_in_details(client):
    body = client.post("/generate", json={"inputs": "a", "parameters": {"max_new_tokens": 2, "details": True,
                                                                        "top_n_tokens": 2}}).json()
    top = body["details"]["top_tokens"]
    assert len(top) == 2 and [len(t) for t in top] == [2, 2]
    assert top[0][0]["logprob"] == -0.5


def test_best_of_returns_the_best_and_the_others(client):
    for _ in range(3):  # whichever copy the engine took first, the best one wins
        body = client.post("/generate", json={"inputs": "VARY", "parameters": {"max_new_tokens": 2, "best_of": 2,
                                                                               "do_sample": True, "details": True}})
        details = body.json()["details"]
        (other,) = details["best_of_sequences"]
        assert other["generated_tokens"] == 2 and other["generated_text"] != body.json()["generated_text"]
        assert [t["text"] for t in other["tokens"]] == list(other["generated_text"])
        mean = lambda tokens: sum(t["logprob"] for t in tokens) / len(tokens)  # noqa: E731
        assert mean(details["tokens"]) > mean(other["tokens"])


def test_compat_route_wraps_in_list_and_streams(client):
    r = client.post("/", json={"inputs": "a", "parameters": {"max_new_tokens": 2}})
    assert r.json() == [{"generated_text": "th"}]
    r = client.post("/", json={"inputs": "a", "stream": True, "parameters": {"max_new_tokens": 2}})
    assert r.headers["content-type"].startswith("text/event-stream")
    assert len(sse_events(r.text)) == 2


def test_no_parameters_means_sampling_like_tgi(served):
    client, fake = served
    before = set(fake.seen)
    assert client.post("/generate", json={"inputs": "EOS"}).status_code == 200
    (rid,) = set(fake.seen) - before
    assert fake.seen[rid].do_sample is True


# --- /generate_stream ---------------------------------------------------------------------------

def test_stream_framing_and_last_event(client):
    r = client.post("/generate_stream", json={"inputs": "ab", "parameters": {"max_new_tokens": 4, "details": True,
                                                                             "top_n_tokens": 1}})
    assert r.status_code == 200
    events = sse_events(r.text)
    assert all(e.startswith("data:{") for e in events)
    payloads = [json.loads(e[len("data:"):]) for e in events]
    assert [p["index"] for p in payloads] == [1, 2, 3, 4]
    assert "".join(p["token"]["text"] for p in payloads) == "the "
    assert all(p["generated_text"] is None and p["details"] is None for p in payloads[:-1])
    assert payloads[-1]["generated_text"] == "the "
    assert payloads[-1]["details"] == {"finish_reason": "length", "generated_tokens": 4, "seed": 7, "input_length": 3}
    assert len(payloads[0]["top_tokens"]) == 1


def test_stream_error_is_final_event(client):
    r = client.post("/generate_stream", json={"inputs": "FAIL", "parameters": {"max_new_tokens": 4}})
    (event,) = sse_events(r.text)
    assert json.loads(event[len("data:"):]) == {
        "error": "Request failed during generation: CUDA out of memory", "error_type": "generation"}


def test_stream_that_ends_early_is_incomplete_generation(client):
    r = client.post("/generate_stream", json={"inputs": "ABORT", "parameters": {"max_new_tokens": 9}})
    events = [json.loads(e[len("data:"):]) for e in sse_events(r.text)]
    assert events[-1] == {"error": "Incomplete generation", "error_type": "incomplete_generation"}
    r = client.post("/generate", json={"inputs": "ABORT", "parameters": {"max_new_tokens": 9}})
    assert r.status_code == 500
    assert r.json() == {"error": "Incomplete generation", "error_type": "incomplete_generation"}


def test_generation_error_is_424(client):
    r = client.post("/generate", json={"inputs": "FAIL"})
    assert r.status_code == 424
    assert r.json() == {"error": "Request failed during generation: CUDA out of memory", "error_type": "generation"}


# --- validation ---------------------------------------------------------------------------------

@pytest.mark.parametrize("parameters, message", [
    ({"temperature": 0}, "`temperature` must be strictly positive"),
    ({"temperature": -1, "do_sample": True}, "`temperature` must be strictly positive"),
    ({"top_p": 1.0}, "`top_p` must be > 0.0 and < 1.0"),
    ({"top_p": 0}, "`top_p` must be > 0.0 and < 1.0"),
    ({"top_k": 0}, "`top_k` must be strictly positive"),
    ({"typical_p": 1.5}, "`typical_p` must be > 0.0 and < 1.0"),
    ({"repetition_penalty": 0}, "`repetition_penalty` must be strictly positive"),
    ({"frequency_penalty": 3}, "`frequency_penalty` must be >= -2.0 and <= 2.0"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "`stop` supports up to 4 stop sequences. Given: 5"),
    ({"max_new_tokens": 0}, "`max_new_tokens` must be strictly positive"),
    ({"max_new_tokens": 300}, "`inputs` tokens + `max_new_tokens` must be <= 256. Given: 3 `inputs` tokens and 300 `max_new_tokens`"),
    ({"top_n_tokens": 6}, "`top_n_tokens` must be >= 0 and <= 5. Given: 6"),
    ({"best_of": 3, "do_sample": True}, "`best_of` must be > 0 and <= 2. Given: 3"),
    ({"best_of": 2}, "you must use sampling when `best_of` is > 1"),
    ({"best_of": 2, "do_sample": True, "seed": 1}, "`seed` must not be set when `best_of` > 1"),
    ({"watermark": True}, "`watermark` is not supported by this server"),
    ({"grammar": {"type": "json", "value": {"type": "objekt"}}},
     "Grammar is not valid: `grammar.value` is not a valid JSON schema: 'objekt' is not valid under any of the given schemas (at `type`)"),
    ({"grammar": {"type": "json", "value": {"type": "object", "not": {"required": ["a"]}}}},
     'Grammar is not valid: `grammar.value` uses a JSON schema feature this server cannot enforce: Unimplemented keys: ["not"]'),
    ({"grammar": {"type": "json", "value": "{not json"}},
     "Grammar is not valid: `grammar.value` is not valid JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"),
    ({"grammar": {"type": "json", "value": [1, 2]}}, "Grammar is not valid: `grammar.value` must be a JSON schema object, got list"),
    ({"grammar": {"type": "json"}}, "Grammar is not valid: `grammar.value` must be a JSON schema"),
    ({"grammar": {"type": "regex", "value": "[0-9"}},
     'Grammar is not valid: `grammar.value` is not a regular expression this server can compile: at 1(8): invalid regex "[0-9" (in regex): regex parse error: error: unclosed character class'),
    ({"grammar": {"type": "regex", "value": ""}}, "Grammar is not valid: `grammar.value` must be a non-empty regular expression string"),
    ({"grammar": {"type": "lark", "value": "start: x"}}, '`grammar.type` must be "json" or "regex". Given: \'lark\''),
    ({"grammar": "json"}, '`grammar` must be {"type": "json" | "regex", "value": ...}'),
    ({"truncate": 0}, "`truncate` must be strictly positive and less than 200. Given: 0"),
    ({"max_new_tokens": "many"}, "`parameters.max_new_tokens`: Input should be a valid integer"),
    # no coercion: the server accepts what /api-doc/openapi.json declares, not what pydantic could convert
    ({"top_n_tokens": "2"}, "`parameters.top_n_tokens`: Input should be a valid integer"),
    ({"top_n_tokens": True}, "`parameters.top_n_tokens`: Input should be a valid integer"),
    ({"top_n_tokens": 1.5}, "`parameters.top_n_tokens`: Input should be a valid integer"),
    ({"do_sample": "yes"}, "`parameters.do_sample`: Input should be a valid boolean"),
    ({"seed": 2**64}, "`parameters.seed`: Input should be less than or equal to 18446744073709551615"),
    ({"max_new_tokens": -1}, "`parameters.max_new_tokens`: Input should be greater than or equal to 0"),
])
def test_validation_errors(client, parameters, message):
    r = client.post("/generate", json={"inputs": "ab", "parameters": parameters})
    assert r.status_code == 422, r.text
    assert r.json() == {"error": f"Input validation error: {message}", "error_type": "validation"}


def test_input_too_long_empty_and_bad_json(client):
    r = client.post("/generate", json={"inputs": "z" * 250, "parameters": {"max_new_tokens": 1}})
    assert r.json()["error"] == "Input validation error: `inputs` must have less than 200 tokens. Given: 251"
    r = client.post("/generate", json={"inputs": ""})
    assert r.json()["error"] == "Input validation error: `inputs` cannot be empty"
    r = client.post("/generate", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["error_type"] == "validation"
    assert "invalid JSON" in r.json()["error"]
    r = client.post("/generate", json={"parameters": {}})
    assert r.status_code == 422 and "`inputs`: Field required" in r.json()["error"]


def test_unknown_fields_are_ignored_like_tgi(client):
    r = client.post("/generate", json={"inputs": "a", "parameters": {"max_new_tokens": 1, "adapter_id": None,
                                                                     "made_up": 1}, "extra": True})
    assert r.status_code == 200


def test_stream_only_limits(client):
    r = client.post("/generate_stream", json={"inputs": "a", "parameters": {"best_of": 2, "do_sample": True}})
    assert r.status_code == 422 and "not supported when streaming" in r.json()["error"]
    r = client.post("/generate_stream", json={"inputs": "a", "parameters": {"decoder_input_details": True}})
    assert r.status_code == 422 and "`decoder_input_details`" in r.json()["error"]


def test_unexpected_error_is_a_plain_500_without_traceback():
    app, engine, _ = make_app()
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.post("/generate", json={"inputs": "BOOM"})
        assert r.status_code == 500
        assert r.json() == {"error": "Internal server error", "error_type": "internal"}
    engine.close()


def test_unknown_route_keeps_error_shape(client):
    r = client.get("/nope")
    assert r.status_code == 404 and set(r.json()) == {"error", "error_type"}
    # every method /api-doc/openapi.json does not declare: 405 with TGI's body and an Allow header
    for method, path, allow in [("get", "/generate", "POST"), ("get", "/", "POST"), ("head", "/health", "GET"),
                                ("put", "/v1/completions", "POST"), ("delete", "/info", "GET"),
                                ("post", "/v1/models", "GET")]:
        r = client.request(method.upper(), path)
        assert r.status_code == 405 and r.headers["allow"] == allow, (method, path)
        if method != "head":
            assert r.json()["error_type"] == "method_not_allowed"


# --- OpenAI routes ------------------------------------------------------------------------------

def test_chat_completion(served):
    client, fake = served
    before = set(fake.seen)
    r = client.post("/v1/chat/completions", json={
        "model": "anything", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0,
        "logprobs": True, "top_logprobs": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == "fake-model"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "the"}
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len("<user>hi\n<assistant>"), "completion_tokens": 3,
                             "total_tokens": len("<user>hi\n<assistant>") + 3,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert len(body["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2
    (rid,) = set(fake.seen) - before
    assert fake.seen[rid].do_sample is False  # temperature 0 = greedy


def test_chat_completion_stream_with_usage(client):
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True,
        "stream_options": {"include_usage": True}})
    events = sse_events(r.text)
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks[:-1]) == "the"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3


def test_stop_sequence_kept_by_tgi_and_cut_by_openai(client):
    tgi = client.post("/generate", json={"inputs": "x", "parameters": {"stop": ["quick"]}}).json()
    events = [json.loads(line[5:]) for line in client.post(
        "/generate_stream", json={"inputs": "x", "parameters": {"stop": ["quick"]}}).text.split("\n\n") if line]
    oai = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 20, "stop": ["quick"]}).json()
    assert tgi["generated_text"] == events[-1]["generated_text"] == "the quick"
    assert oai["choices"][0]["text"] == "the " and oai["choices"][0]["finish_reason"] == "stop"


def test_completions(client):
    r = client.post("/v1/completions", json={"prompt": "EOS", "max_tokens": 10})
    body = r.json()
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == "the"
    assert body["choices"][0]["finish_reason"] == "stop"
    r = client.post("/v1/completions", json={"prompt": ["a"], "max_tokens": 2, "stream": True})
    events = sse_events(r.text)
    assert events[-1] == "data: [DONE]" and len(events) == 3


def _new_requests(fake, before):
    return [(rid, fake.seen[rid]) for rid in fake.seen if rid not in before]


def test_completions_n_with_seed_fans_out_in_order(served):
    client, fake = served
    before = set(fake.seen)
    body = client.post("/v1/completions", json={"prompt": "ab", "n": 3, "max_tokens": 4, "seed": 5,
                                               "temperature": 0.7}).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["text"] for c in body["choices"]] == ["the "] * 3
    assert [p.seed for _, p in _new_requests(fake, before)] == [5, 6, 7]    # choice j samples with seed + j
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 12, "total_tokens": 15,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    # no seed: the engine picks one per sequence
    before = set(fake.seen)
    client.post("/v1/completions", json={"prompt": "ab", "n": 2, "max_tokens": 1})
    assert [p.seed for _, p in _new_requests(fake, before)] == [None, None]


def test_completions_batched_prompts_and_token_ids(served):
    client, fake = served
    before = set(fake.seen)
    ids = [ord(c) + OFFSET for c in "xyz"]
    body = client.post("/v1/completions", json={"prompt": [ids, [ord("q") + OFFSET]], "n": 2, "max_tokens": 2,
                                               "echo": True}).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == ["xyzth", "xyzth", "qth", "qth"]
    prompts = [p for _, p in _new_requests(fake, before)]
    assert len(prompts) == 4 and body["usage"]["prompt_tokens"] == 4      # token ids: no BOS added
    body = client.post("/v1/completions", json={"prompt": ["ab", "c"], "max_tokens": 1}).json()
    assert [c["text"] for c in body["choices"]] == ["t", "t"] and body["usage"]["prompt_tokens"] == 5


def test_completions_echo_logprobs_scoring(served):
    client, fake = served
    before = set(fake.seen)
    ids = [BOS, ord("h") + OFFSET, ord("i") + OFFSET]
    body = client.post("/v1/completions", json={"prompt": [ids, ids], "n": 2, "echo": True, "logprobs": 1,
                                               "max_tokens": 0}).json()
    new = _new_requests(fake, before)
    # each prompt's first sequence starts first and alone computes the prompt logprobs
    assert [p.prefill_logprobs for _, p in new] == [True, True, False, False]
    assert all(p.max_new_tokens == 1 and p.top_n_tokens == 1 for _, p in new)
    for choice in body["choices"]:
        lp = choice["logprobs"]
        assert choice["text"] == "hi" and choice["finish_reason"] == "length"
        assert lp["token_logprobs"] == [None, -1.0, -1.0] and lp["top_logprobs"][0] is None
        assert lp["tokens"][1:] == ["h", "i"] and lp["text_offset"] == [0, 0, 1]
    assert body["usage"]["completion_tokens"] == 0


def test_completions_logprobs_without_echo_and_streamed(client):
    body = client.post("/v1/completions", json={"prompt": "ab", "logprobs": 2, "max_tokens": 3}).json()
    lp = body["choices"][0]["logprobs"]
    assert lp["tokens"] == ["t", "h", "e"] and lp["token_logprobs"] == [-0.25] * 3
    assert lp["text_offset"] == [0, 1, 2] and len(lp["top_logprobs"][0]) == 2
    r = client.post("/v1/completions", json={"prompt": "ab", "logprobs": 1, "max_tokens": 3, "stream": True})
    chunks = [json.loads(e[len("data: "):]) for e in sse_events(r.text)[:-1]]
    assert [c["choices"][0]["logprobs"]["text_offset"] for c in chunks] == [[0], [1], [2]]
    assert [c["choices"][0]["logprobs"]["tokens"] for c in chunks] == [["t"], ["h"], ["e"]]


def test_streamed_choices_interleave_with_their_index(served):
    client, fake = served
    before = set(fake.seen)
    r = client.post("/v1/completions", json={"prompt": ["ab", "cd"], "n": 2, "max_tokens": 3, "seed": 1,
                                             "logprobs": 0, "stream": True, "stream_options": {"include_usage": True}})
    events = sse_events(r.text)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    by_index: dict[int, list] = {}
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        by_index.setdefault(choice["index"], []).append(choice)
    assert sorted(by_index) == [0, 1, 2, 3]
    for choices in by_index.values():
        assert "".join(c["text"] for c in choices) == "the"
        assert [c["logprobs"]["text_offset"] for c in choices] == [[0], [1], [2]]
        assert [c["finish_reason"] for c in choices] == [None, None, "length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    assert sorted(p.seed for _, p in _new_requests(fake, before)) == [1, 1, 2, 2]
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "n": 3,
                                                  "max_tokens": 2, "stream": True})
    chunks = [json.loads(e[len("data: "):]) for e in sse_events(r.text)[:-1]]
    assert sorted({c["choices"][0]["index"] for c in chunks}) == [0, 1, 2] and len(chunks) == 6


def test_stream_of_choices_ends_with_an_error_event(client):
    r = client.post("/v1/completions", json={"prompt": ["ab", "FAIL"], "max_tokens": 3, "stream": True})
    events = sse_events(r.text)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][len("data: "):])["error_type"] == "generation"


def test_best_of_returns_the_highest_cumulative_logprob(served):
    client, fake = served
    before = set(fake.seen)
    body = client.post("/v1/completions", json={"prompt": "VARY", "best_of": 3, "max_tokens": 3,
                                               "logprobs": 0}).json()
    assert len(_new_requests(fake, before)) == 3 and len(body["choices"]) == 1
    assert body["choices"][0]["logprobs"]["token_logprobs"] == [max(lp for lp in (-0.25 * (1 + v % 7)
                                                                 for v in _variants(fake, before)))] * 3
    assert body["usage"]["completion_tokens"] == 3       # the returned choices'


def _variants(fake, before):
    return [len([r for r in fake.seen if r in before]) + i for i in range(3)]


def test_chat_n_choices(client):
    body = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "n": 2,
                                                     "max_tokens": 2, "logprobs": True, "top_logprobs": 1}).json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert all(c["message"]["content"] == "th" for c in body["choices"])
    assert all(len(c["logprobs"]["content"][0]["top_logprobs"]) == 1 for c in body["choices"])
    assert body["usage"]["completion_tokens"] == 4


def test_max_new_tokens_default():
    app, engine, fake = make_app(max_new_tokens_default=10)
    with TestClient(app) as client:
        for route, body in [("/generate", {"inputs": "abc", "parameters": {"max_new_tokens": None}}),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                            ("/v1/completions", {"prompt": "abc"})]:
            before = set(fake.seen)
            assert client.post(route, json=body).status_code == 200
            ((_, params),) = _new_requests(fake, before)
            assert params.max_new_tokens == 10, route
        # a request's own limit is refused, not cut, when it does not fit (as TGI, OpenAI and vLLM do)
        r = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 253})
        assert r.status_code == 422 and "must be <= 256. Given: 4 `inputs` tokens and 253" in r.json()["error"]
        assert client.get("/info").json()["max_new_tokens_default"] == 10
    engine.close()
    app, engine, fake = make_app()          # default 1024: cut to the room left; completions keep OpenAI's 16
    with TestClient(app) as client:
        before = set(fake.seen)
        client.post("/v1/completions", json={"prompt": "abc", "max_tokens": None})
        client.post("/generate", json={"inputs": "z" * 199, "parameters": {"details": True}})
        assert [p.max_new_tokens for _, p in _new_requests(fake, before)] == [16, 256 - 200]
    engine.close()


@pytest.mark.parametrize("route, body, fragment", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 0}, "`n`: Input should be greater"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 129}, "must be <= 128 sequences"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 2, "stream": True,
                              "tools": [{"type": "function", "function": {"name": "f"}}]},
     "`n` > 1 with `tools` is not supported when streaming"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 6},
     "`top_logprobs` must be <= 5"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
     "`messages.0.content"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "`n`: Input should be greater than or equal to 1"),
    ("/v1/completions", {"prompt": "x", "best_of": 129}, "Given: 1 x 129"),
    ("/v1/completions", {"prompt": ["x"] * 3, "n": 50}, "Given: 3 x 50"),
    ("/v1/completions", {"prompt": "x", "n": 3, "best_of": 2}, "`best_of` must be >= `n`"),
    ("/v1/completions", {"prompt": "x", "logprobs": 6}, "`logprobs` must be <= 5"),
    ("/v1/completions", {"prompt": [5, 100000]}, "token ids must be >= 0 and < 1000 (the vocabulary). Given: 100000"),
    ("/v1/completions", {"prompt": [[5], [-1]]}, "Given: -1"),
    ("/v1/completions", {"prompt": [5] * 201}, "`inputs` must have less than 200 tokens. Given: 201"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
     "`max_new_tokens` must be strictly positive"),
    ("/v1/completions", {"prompt": []}, "`prompt` must be a string, a list of strings"),
    ("/v1/completions", {"prompt": [[]]}, "`prompt` must be a string, a list of strings"),
    ("/v1/completions", {"prompt": [[1, 2], "x"]}, "`prompt` must be a string, a list of strings"),
    ("/v1/completions", {"prompt": [1, "x"]}, "`prompt` must be a string, a list of strings"),
    ("/v1/completions", {"prompt": [1, 2.0]}, "`prompt` must be a string, a list of strings"),
    ("/v1/completions", {"prompt": [True]}, "`prompt` must be a string, a list of strings"),
    ("/v1/completions", {"prompt": [[[1]]]}, "`prompt` must be a string, a list of strings"),
    ("/v1/completions", {"prompt": ""}, "`inputs` cannot be empty"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "`max_tokens` 0 generates nothing: it needs `echo`"),
    ("/v1/completions", {"prompt": "x", "best_of": 2, "stream": True}, "`best_of` must equal `n` when streaming"),
    ("/v1/completions", {"prompt": ["x", "y"], "n": 2, "stream": True, "max_tokens": 999}, "must be <= 256"),
    ("/v1/completions", {"prompt": "x", "seed": -1}, "`seed`: Input should be greater than or equal to 0"),
    ("/v1/chat/completions", {"messages": [{"role": "bad", "content": "x"}]}, "chat template error"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{}]}, "`tools[0].function` is required"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"description": "no name"}}]},
     "`tools[0].function.name` is required"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "a b; rm"}}]},
     "`tools[0].function.name` must be 1-64 letters"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]},
     "`tools[0].function.parameters` is not a valid JSON schema"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}]},
     "two functions with the same name"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
     "`tool_choice` is set but `tools` is empty"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "`tool_choice.function.name` 'g' is not in `tools`"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "sometimes"},
     "`tool_choice` must be"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "1"}]},
     "`messages[1].tool_call_id` is required"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "`response_format.json_schema.schema` is not a valid JSON schema"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "`response_format.json_schema.name` is required"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
     "`response_format.type` must be"),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}}}},
     "cannot enforce: Unimplemented keys"),
    ("/v1/chat/completions", {"messages": []}, "`messages`"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, "Suffix is not supported"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 999}, "must be <= 256"),
])
def test_openai_validation_uses_tgi_body(served, route, body, fragment):
    client, fake = served
    num_seen = len(fake.seen)
    r = client.post(route, json=body)
    assert r.status_code == 422, r.text
    assert r.json()["error_type"] == "validation" and fragment in r.json()["error"]
    assert len(fake.seen) == num_seen      # nothing reached the engine


def test_bad_grammar_never_reaches_the_engine(served):
    client, fake = served
    num_seen = len(fake.seen)
    for route in ("/generate", "/generate_stream", "/"):
        r = client.post(route, json={"inputs": "ab", "parameters": {"grammar": {"type": "regex", "value": "(a"}}})
        assert r.status_code == 422 and "`grammar.value`" in r.json()["error"], r.text
    assert len(fake.seen) == num_seen


def test_grammar_reaches_the_engine_compiled(served):
    client, fake = served
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for route, body in [("/generate", {"inputs": "ab", "parameters": {"grammar": {"type": "json", "value": schema}}}),
                        ("/generate", {"inputs": "ab", "parameters": {"grammar": {"type": "json_object",
                                                                                  "value": json.dumps(schema)}}}),
                        ("/v1/completions", {"prompt": "ab", "response_format": {"type": "json_object"}})]:
        before = set(fake.seen)
        assert client.post(route, json=body).status_code == 200
        (rid,) = set(fake.seen) - before
        assert fake.seen[rid].grammar is not None and fake.seen[rid].grammar.kind == "json"


def test_models_tokenize_info(client):
    assert client.get("/v1/models").json()["data"][0]["id"] == "fake-model"
    toks = client.post("/tokenize", json={"inputs": "ab"}).json()
    assert toks[1:] == [{"id": ord("a") + OFFSET, "text": "a", "start": 0, "stop": 1},
                        {"id": ord("b") + OFFSET, "text": "b", "start": 1, "stop": 2}]
    info = client.get("/info").json()
    assert info["model_id"] == "fake-model" and info["max_total_tokens"] == 256
    assert info["max_input_tokens"] == 200 and info["attention_backend"] == "fake"
    assert info["grammar_support"] is True and info["grammar_types"] == ["json", "regex"]
    assert info["grammar_backend"].startswith("llguidance ")
    for key in ("model_dtype", "model_device_type", "max_best_of", "max_stop_sequences", "version", "num_shard"):
        assert key in info


def test_docs_and_openapi(client):
    spec = client.get("/api-doc/openapi.json").json()
    assert {"/generate", "/generate_stream", "/v1/chat/completions", "/health"} <= set(spec["paths"])
    assert "GenerateRequest" in spec["components"]["schemas"]
    assert "swagger" in client.get("/docs").text.lower()
    # every route the app serves, with each of its methods, is in the document, and nothing else is
    served = {(method.lower(), route.path) for route in client.app.routes for method in route.methods}
    declared = {(method, path) for path, operations in spec["paths"].items() for method in operations}
    assert served == declared


# --- metrics and health -------------------------------------------------------------------------

def test_metrics_use_tgi_names(client):
    client.post("/generate", json={"inputs": "a", "parameters": {"max_new_tokens": 1}})
    client.post("/generate", json={"inputs": "a", "parameters": {"top_k": 0}})
    text = client.get("/metrics").text
    for name in ("tgi_request_count", "tgi_request_success", "tgi_request_duration_bucket",
                 "tgi_request_validation_duration_sum", "tgi_request_queue_duration_count",
                 "tgi_request_inference_duration_sum", "tgi_request_mean_time_per_token_duration_sum",
                 "tgi_request_input_length_bucket", "tgi_request_generated_tokens_sum", "tgi_queue_size",
                 "tgi_batch_current_size", "tgi_batch_current_max_tokens", "tgi_kv_cache_blocks_free",
                 "tgi_kv_cache_blocks_total", "tgi_kv_cache_usage"):
        assert f"\n{name}" in text, name
    assert 'tgi_request_failure{err="validation"}' in text
    assert "tgi_request_count_total" not in text


def test_health_ok_runs_a_probe(served):
    client, fake = served
    before = set(fake.seen)
    assert client.get("/health").status_code == 200
    assert any(rid.startswith("health-") for rid in set(fake.seen) - before)


def test_crashed_engine_is_503_and_424():
    app, engine, fake = make_app()
    with TestClient(app) as client:
        fake.crash = True
        r = client.post("/generate", json={"inputs": "a", "parameters": {"max_new_tokens": 1}})
        assert r.status_code == 424 and r.json()["error_type"] == "generation"
        r = client.get("/health")
        assert r.status_code == 503 and r.json() == {"error": "unhealthy", "error_type": "healthcheck"}
        r = client.post("/generate", json={"inputs": "a"})
        assert r.status_code == 424 and "engine stopped" in r.json()["error"]


# --- API key and CORS ---------------------------------------------------------------------------

def test_api_key():
    app, engine, _ = make_app(api_key="s3cret")
    with TestClient(app) as client:
        for method, path in [("post", "/generate"), ("post", "/generate_stream"), ("post", "/"),
                             ("post", "/tokenize"), ("post", "/v1/chat/completions"), ("get", "/v1/models")]:
            r = client.request(method, path, json={"inputs": "a"})
            assert r.status_code == 401, path
            assert r.json() == {"error": "Unauthorized", "error_type": "unauthorized"}
        bad = client.post("/generate", json={"inputs": "a"}, headers={"Authorization": "Bearer s3cre"})
        assert bad.status_code == 401
        ok = client.post("/generate", json={"inputs": "a", "parameters": {"max_new_tokens": 1}},
                         headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
        for path in ("/health", "/info", "/metrics", "/docs"):
            assert client.get(path).status_code == 200, path
    engine.close()


def test_cors():
    app, engine, _ = make_app(cors_allow_origin=["https://ui.example"])
    with TestClient(app) as client:
        r = client.options("/generate", headers={"Origin": "https://ui.example", "Access-Control-Request-Method": "POST"})
        assert r.headers["access-control-allow-origin"] == "https://ui.example"
    engine.close()


# --- real uvicorn: admission and disconnect -----------------------------------------------------

def test_overloaded_is_429_and_disconnect_frees_blocks():
    fake = FakeEngine(step_delay_s=0.02)
    app, engine, _ = make_app(fake, max_concurrent_requests=1)
    with uvicorn_server(app) as url, httpx.Client(base_url=url, timeout=10) as http:
        with http.stream("POST", "/generate_stream", json={"inputs": "a", "parameters": {"max_new_tokens": 200}}) as r:
            lines = r.iter_lines()
            first = next(lines)
            assert first.startswith("data:{") and '"index":1' in first
            assert fake.stats().num_free_blocks < fake.num_total_blocks
            busy = http.post("/generate", json={"inputs": "a", "parameters": {"max_new_tokens": 1}})
            assert busy.status_code == 429
            assert busy.json() == {"error": "Model is overloaded", "error_type": "overloaded"}
        # the client closed the stream after one event: the request is aborted and its blocks are freed
        deadline = time.monotonic() + 5
        while fake.stats().num_free_blocks != fake.num_total_blocks and time.monotonic() < deadline:
            time.sleep(0.02)
        assert fake.stats().num_free_blocks == fake.num_total_blocks
        assert len(fake.aborted) == 1
        # and the permit came back
        assert http.post("/generate", json={"inputs": "a", "parameters": {"max_new_tokens": 1}}).status_code == 200
        assert "tgi_kv_cache_blocks_free 256.0" in http.get("/metrics").text
    engine.close()


def test_non_streaming_client_disconnect_aborts():
    fake = FakeEngine(step_delay_s=0.02)
    app, engine, _ = make_app(fake)
    with uvicorn_server(app) as url:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/generate", json={"inputs": "a", "parameters": {"max_new_tokens": 200}}, timeout=0.3)
        deadline = time.monotonic() + 5
        while not fake.aborted and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(fake.aborted) == 1
        assert fake.stats().num_free_blocks == fake.num_total_blocks
        assert 'tgi_request_failure{err="client_disconnected"} 1.0' in httpx.get(f"{url}/metrics").text
    engine.close()


def test_outputs_that_wait_together_come_out_together_and_those_before_a_failure_still_arrive():
    """AsyncEngine.generate_runs gives a stream every output already waiting (so its events can go out in one
    socket write when the event loop falls behind the steps); outputs queued before the engine failed are still
    delivered, then the failure."""
    import asyncio

    fake = FakeEngine(step_delay_s=0.002)
    engine = AsyncEngine(fake).start()
    prompt = CharTokenizer().encode("hello")

    async def first_runs(crash_after: bool, runs: list) -> None:
        gen = engine.generate_runs("r-crash" if crash_after else "r", prompt,
                                   SamplingParams(max_new_tokens=200 if crash_after else 30))
        try:
            runs.append(await gen.__anext__())      # the first step's output, then the loop is held up...
            time.sleep(0.1)                          # ...while the engine runs ~50 more steps
            if crash_after:
                fake.crash = True
                time.sleep(0.1)
            async for run in gen:
                runs.append(run)
        finally:
            await gen.aclose()

    try:
        runs: list = []
        asyncio.run(first_runs(False, runs))
        texts = "".join(out.text for run in runs for out in run)
        assert texts == SCRIPT[:30] and runs[-1][-1].finished
        assert len(runs) < 30 and max(len(run) for run in runs) > 5   # the waiting ones in one run
        before_crash: list = []
        with pytest.raises(RequestFailedError, match="engine stopped"):
            asyncio.run(first_runs(True, before_crash))
        delivered = [out for run in before_crash for out in run]
        assert len(delivered) > 10 and not delivered[-1].finished    # the steps before the crash reached the stream
        assert "".join(out.text for out in delivered) == (SCRIPT * 5)[:len(delivered)]
    finally:
        engine.close()


def test_a_stream_writes_the_events_that_came_together_in_one_chunk(served):
    """The SSE response joins the events of outputs that were waiting together into one body chunk (one write);
    a client reads the same events."""
    from engine.server import streaming
    from engine.server.infer import StreamEvent

    class Infer:
        async def stream(self, valid, arrival):
            for i, (text, flush) in enumerate([("a", False), ("b", False), ("c", True), ("d", True)]):
                yield StreamEvent(i + 1, TokenInfo(i, text, -0.5, False), text, flush=flush)

    import asyncio

    async def chunks():
        state = SimpleNamespace(infer=Infer())
        return [c async for c in streaming._events(state, None, 0.0, lambda ev, valid: [ev.text.encode()], False)]

    assert asyncio.run(chunks()) == [b"abc", b"d"]
