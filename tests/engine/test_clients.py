"""The real launcher (`python -m engine`, real uvicorn, real LLMEngine on a tiny model) against the real,
unmodified clients: text_generation, huggingface_hub.InferenceClient and openai."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("torch")
text_generation = pytest.importorskip("text_generation")
huggingface_hub = pytest.importorskip("huggingface_hub")
openai = pytest.importorskip("openai")

# text_generation calls pydantic's deprecated .dict(); not ours to fix
pytestmark = pytest.mark.filterwarnings("ignore:The `dict` method is deprecated")

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "test-key-4f1b2c"
PROMPT = "The capital of France is"


def start_server(model_dir: Path, tmp_path: Path, *extra: str, env: dict[str, str] | None = None,
                 timeout_s: float = 120.0) -> tuple[subprocess.Popen, str, Path]:
    """Start `python -m engine` on 127.0.0.1:<free port>; return (process, base url, log file).

    Also used by test_launcher.py."""
    ready, log = tmp_path / "ready.json", tmp_path / "server.log"
    argv = [sys.executable, "-m", "engine", "--model-id", str(model_dir), "--hostname", "127.0.0.1", "--port", "0",
            "--ready-file", str(ready), *extra]
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, env=full_env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"server did not start (exit {proc.poll()}):\n{log.read_text()[-3000:]}")
        time.sleep(0.1)
    return proc, f"http://127.0.0.1:{json.loads(ready.read_text())['port']}", log


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    proc, url, log = start_server(model_path("tiny-llama"), tmp_path_factory.mktemp("server"),
                                  env={"API_KEY": API_KEY})
    yield url
    try:
        # after every test (module scope): nothing is left holding KV blocks
        assert_all_blocks_free(url)
    finally:
        stop_server(proc)
        assert API_KEY not in log.read_text()


def kv_gauges(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
            if line.startswith("tgi_kv_cache_blocks")}


def assert_all_blocks_free(url: str) -> None:
    deadline = time.monotonic() + 5
    while (g := kv_gauges(url))["tgi_kv_cache_blocks_free"] != g["tgi_kv_cache_blocks_total"]:
        assert time.monotonic() < deadline, g
        time.sleep(0.05)


def test_text_generation_client(server):
    client = text_generation.Client(server, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    resp = client.generate(PROMPT, max_new_tokens=8, decoder_input_details=True, top_n_tokens=2)
    assert resp.details.generated_tokens == 8 == len(resp.details.tokens)
    assert resp.details.finish_reason.value == "length"
    assert len(resp.details.prefill) > 1 and len(resp.details.top_tokens[0]) == 2
    events = list(client.generate_stream(PROMPT, max_new_tokens=8))
    assert len(events) == 8
    assert all(e.generated_text is None for e in events[:-1])
    assert events[-1].generated_text == resp.generated_text  # greedy: the same text either way
    assert "".join(e.token.text for e in events) == resp.generated_text
    assert events[-1].details.generated_tokens == 8
    best = client.generate(PROMPT, max_new_tokens=4, best_of=2, do_sample=True)
    assert len(best.details.best_of_sequences) == 1 and best.details.generated_tokens == 4
    with pytest.raises(text_generation.errors.ValidationError):
        client.generate(PROMPT, max_new_tokens=100_000)


def test_text_generation_async_client_and_auth(server):
    async def run() -> str:
        client = text_generation.AsyncClient(server, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
        return (await client.generate(PROMPT, max_new_tokens=3)).generated_text
    assert asyncio.run(run())
    with pytest.raises(text_generation.errors.UnknownError):  # the client has no class for 401
        text_generation.Client(server, timeout=60).generate(PROMPT, max_new_tokens=3)


def test_huggingface_hub_text_generation(server):
    client = huggingface_hub.InferenceClient(model=server, token=API_KEY, timeout=60)
    out = client.text_generation(PROMPT, max_new_tokens=6, details=True)
    assert out.details.generated_tokens == 6 and out.details.finish_reason == "length"
    pieces = list(client.text_generation(PROMPT, max_new_tokens=6, stream=True))
    assert "".join(pieces) == out.generated_text
    events = list(client.text_generation(PROMPT, max_new_tokens=6, stream=True, details=True))
    assert [e.token.id for e in events] == [t.id for t in out.details.tokens]
    assert events[-1].details.finish_reason == "length" and events[-1].generated_text == out.generated_text


def test_huggingface_hub_chat_completion(server):
    client = huggingface_hub.InferenceClient(base_url=f"{server}/v1", api_key=API_KEY, timeout=60)
    messages = [{"role": "user", "content": "Hello!"}]
    out = client.chat_completion(messages, max_tokens=5, temperature=0)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 5
    chunks = list(client.chat_completion(messages, max_tokens=5, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content for c in chunks) == out.choices[0].message.content


def test_openai_chat_and_completions(server):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, timeout=60)
    messages = [{"role": "user", "content": "Hello!"}]
    chat = client.chat.completions.create(model="tgi", messages=messages, max_tokens=5, temperature=0)
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 5
    stream = client.chat.completions.create(model="tgi", messages=messages, max_tokens=5, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content for c in chunks if c.choices) == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 5
    comp = client.completions.create(model="tgi", prompt=PROMPT, max_tokens=4, temperature=0)
    assert comp.usage.completion_tokens == 4
    pieces = [c.choices[0].text for c in client.completions.create(model="tgi", prompt=PROMPT, max_tokens=4,
                                                                   temperature=0, stream=True)]
    assert "".join(pieces) == comp.choices[0].text
    assert [m.id for m in client.models.list()] == [json.loads(httpx.get(f"{server}/info").text)["model_id"]]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server}/v1", api_key="wrong").completions.create(model="tgi", prompt="x")


def test_32_concurrent_requests(server):
    async def run() -> list[httpx.Response]:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with httpx.AsyncClient(base_url=server, headers=headers, timeout=120) as http:
            return await asyncio.gather(*(
                http.post("/generate", json={"inputs": f"{PROMPT} {i}", "parameters": {"max_new_tokens": 8 + i % 5}})
                for i in range(32)))
    responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [200] * 32
    assert [int(r.headers["x-generated-tokens"]) for r in responses] == [8 + i % 5 for i in range(32)]
