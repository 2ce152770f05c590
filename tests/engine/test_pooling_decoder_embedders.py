"""Decoder-based embedders in the e5-mistral style (tiny random Mistral and Llama checkpoints with
sentence-transformers files: last-token pooling of "<s> text </s>", instruction prompts, a default prompt)
served through the routes, against sentence-transformers' `encode` with the same prompt, within 1e-4."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
st = pytest.importorskip("sentence_transformers")

from starlette.testclient import TestClient  # noqa: E402

from engine.async_engine import AsyncEngine  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.pooling.engine import PoolingEngine  # noqa: E402
from engine.server.app import build_app  # noqa: E402
from test_pooling_models import mixed_texts  # noqa: E402


@pytest.fixture(scope="module", params=["tiny-mistral-embed", "tiny-llama-embed"])
def served(request, model_path):
    path = str(model_path(request.param))
    config = EngineConfig(model_id=path, device="cpu", served_model_name=request.param)
    engine = AsyncEngine(PoolingEngine(config)).start()
    yield TestClient(build_app(engine, config)), st.SentenceTransformer(path, device="cpu"), engine
    engine.close()


def test_detected_as_last_token_embedder_with_eos(served):
    client, ref, _ = served
    info = client.get("/info").json()
    assert (info["task"], info["pooling"]) == ("embed", "lasttoken")
    ids = [t["id"] for t in client.post("/tokenize", json={"inputs": "a query"}).json()]
    assert ids[-1] == ref.tokenizer.eos_token_id  # the pooled token is the appended </s>, as in e5-mistral


def test_prompts_match_sentence_transformers(served):
    client, ref, _ = served
    texts = [" ".join(t.split()[:60]) for t in mixed_texts(12, seed=7)] + ["x"]
    names = [name for name, text in ref.prompts.items() if text]  # the model's own (ST 6 adds empty query/document)
    assert names
    for name in names:  # each instruction, named on TEI's /embed
        got = torch.tensor(client.post("/embed", json={"inputs": texts, "prompt_name": name}).json())
        want = ref.encode(texts, prompt_name=name, convert_to_tensor=True, batch_size=5).float()
        assert got.shape == want.shape
        assert torch.allclose(got, want, atol=1e-4, rtol=0), (name, (got - want).abs().max())
    # no prompt named: the model's default prompt (Llama's "query"), or none (Mistral), as encode() does
    body = client.post("/v1/embeddings", json={"input": texts, "encoding_format": "float"}).json()
    got = torch.tensor([d["embedding"] for d in body["data"]])
    want = ref.encode(texts, convert_to_tensor=True, batch_size=5).float()
    assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()
    if ref.default_prompt_name:  # and the default differs from no prompt at all
        bare = ref.encode(texts, prompt="", convert_to_tensor=True).float()
        assert not torch.allclose(got, bare, atol=1e-3)


def test_long_input_truncated_keeps_the_last_token(served):
    client, ref, _ = served
    long = " ".join(mixed_texts(40, seed=8)) * 3  # far past max_seq_length (256)
    assert client.post("/embed", json={"inputs": long}).status_code == 422
    got = torch.tensor(client.post("/embed", json={"inputs": [long], "truncate": True}).json())
    want = ref.encode([long], convert_to_tensor=True).float()
    assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()
