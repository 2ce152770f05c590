"""A served tiny embedder (`python -m engine`, uvicorn) under 64 concurrent embedding clients (the real `openai`
client, one thread each) while other threads send it generation requests: every generation request gets the 422
naming the routes served, every embedding comes back to its own client and equals sentence-transformers'. Two CPU
threads: the server's pooling engine has two single-threaded workers (engine/pooling/runner.py)."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

torch = pytest.importorskip("torch")
st = pytest.importorskip("sentence_transformers")
openai = pytest.importorskip("openai")

from test_clients import start_server, stop_server  # noqa: E402
from test_pooling_models import mixed_texts  # noqa: E402

CLIENTS = 64
GENERATION = [("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 4}}),
              ("/generate_stream", {"inputs": "hi"}), ("/v1/completions", {"model": "m", "prompt": "hi"}),
              ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}),
              ("/v1/responses", {"model": "m", "input": "hi"})]
SERVED = "/v1/embeddings, /embed"


@pytest.fixture(scope="module")
def served(model_path, tmp_path_factory):
    path = model_path("tiny-bert-embed")
    proc, url, log = start_server(path, tmp_path_factory.mktemp("mixed"), "--cpu-threads", "2",
                                  "--served-model-name", "tiny-embed", "--max-concurrent-requests", "512")
    yield url, st.SentenceTransformer(str(path), device="cpu")
    stop_server(proc)
    assert "Traceback" not in log.read_text()


def test_64_embedding_clients_mixed_with_generation(served):
    url, ref = served
    texts = [f"client {i}: " + " ".join(t.split()[:20]) for i, t in enumerate(mixed_texts(CLIENTS * 2, seed=11))]
    start = threading.Barrier(CLIENTS + len(GENERATION) + 1)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)

    def embedder(i: int) -> list[list[float]]:
        start.wait()
        one = client.embeddings.create(model="tiny-embed", input=texts[2 * i], encoding_format="float")
        two = client.embeddings.create(model="tiny-embed", input=[texts[2 * i + 1], texts[2 * i]])
        return [one.data[0].embedding, *(d.embedding for d in two.data)]

    def generator(route: str, body: dict) -> list[tuple[int, dict]]:
        start.wait()
        answers = []
        for _ in range(4):
            r = httpx.post(url + route, json=body, timeout=300)
            answers.append((r.status_code, r.json()))
        try:
            client.chat.completions.create(model="tiny-embed", messages=[{"role": "user", "content": "hi"}])
        except openai.UnprocessableEntityError as exc:
            answers.append((exc.status_code, exc.response.json()))  # the client keeps TGI's body whole
        return answers

    with ThreadPoolExecutor(CLIENTS + len(GENERATION)) as pool:
        embeds = [pool.submit(embedder, i) for i in range(CLIENTS)]
        gens = [pool.submit(generator, route, body) for route, body in GENERATION]
        start.wait()
        got = [f.result() for f in embeds]
        refused = [answer for f in gens for answer in f.result()]

    assert len(refused) == len(GENERATION) * 5
    for status, body in refused:
        assert status == 422 and set(body) == {"error", "error_type"}, body
        assert "embedding model" in str(body) and SERVED in str(body), body
    want = ref.encode(texts, convert_to_tensor=True, batch_size=16).float()
    for i, (one, two_a, two_b) in enumerate(got):  # each client its own texts, in its own order
        vectors = torch.tensor([one, two_a, two_b])
        expected = want[[2 * i, 2 * i + 1, 2 * i]]
        assert torch.allclose(vectors, expected, atol=1e-4, rtol=0), (i, (vectors - expected).abs().max())
    metrics = httpx.get(f"{url}/metrics").text
    assert any(line in metrics for line in ("tgi_queue_size 0\n", "tgi_queue_size 0.0\n"))
