"""sentence-transformers 6 prompt semantics through the routes, against the real library on copies of the tiny BERT
embedder with different config_sentence_transformers.json / 1_Pooling files: `prompt_name`, `encode_query` and
`encode_document` (`input_type`), the empty `query`/`document` prompts every model has, a default prompt name that
only those defaults define, `include_prompt: false`, and bad names refused with a 422."""
from __future__ import annotations

import json
import shutil

import pytest

torch = pytest.importorskip("torch")
st = pytest.importorskip("sentence_transformers")

from starlette.testclient import TestClient  # noqa: E402

from engine.async_engine import AsyncEngine  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.pooling.engine import PoolingEngine  # noqa: E402
from engine.server.app import build_app  # noqa: E402
from test_pooling_models import mixed_texts  # noqa: E402
from test_pooling_routes import assert_422  # noqa: E402

VARIANTS = {
    # e5-style names without "document": encode_document still picks the (empty) default "document" first
    "named": dict(prompts={"query": "query: ", "passage": "passage: "}, default_prompt_name=None),
    # a default that only sentence-transformers 6's empty defaults define (this used to be a 422 on every request)
    "default-only": dict(prompts={}, default_prompt_name="query"),
    # INSTRUCTOR-style: the instruction is read by the encoder but left out of the mean
    "excluded": dict(prompts={"query": "Represent the question for retrieval: ", "document": "Represent it: "},
                     default_prompt_name="document", include_prompt=False),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def served(request, model_path, tmp_path_factory):
    variant = dict(VARIANTS[request.param])
    path = tmp_path_factory.mktemp(request.param) / "model"
    shutil.copytree(model_path("tiny-bert-embed"), path)
    include_prompt = variant.pop("include_prompt", True)
    (path / "config_sentence_transformers.json").write_text(json.dumps(variant))
    pooling = json.loads((path / "1_Pooling" / "config.json").read_text())
    (path / "1_Pooling" / "config.json").write_text(json.dumps({**pooling, "include_prompt": include_prompt}))
    config = EngineConfig(model_id=str(path), device="cpu", served_model_name=request.param)
    engine = AsyncEngine(PoolingEngine(config)).start()
    ref = st.SentenceTransformer(str(path), device="cpu")
    assert ref[1].include_prompt is include_prompt
    yield TestClient(build_app(engine, config)), ref
    engine.close()


def close(got, want):
    got, want = torch.tensor(got), want.float()
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()


def embeddings(client, texts, **extra):
    body = client.post("/v1/embeddings", json={"input": texts, **extra})
    assert body.status_code == 200, body.text
    return [d["embedding"] for d in body.json()["data"]]


def test_prompt_names_and_query_document_match_sentence_transformers(served):
    client, ref = served
    texts = [" ".join(t.split()[:40]) for t in mixed_texts(8, seed=3)]
    enc = dict(convert_to_tensor=True, batch_size=3)
    for name in ref.prompts:  # the model's own names and the defaults, on both routes
        close(client.post("/embed", json={"inputs": texts, "prompt_name": name}).json(),
              ref.encode(texts, prompt_name=name, **enc))
        close(embeddings(client, texts, prompt_name=name), ref.encode(texts, prompt_name=name, **enc))
    close(embeddings(client, texts), ref.encode(texts, **enc))  # no name: the default prompt, or none
    close(embeddings(client, texts, input_type="query"), ref.encode_query(texts, **enc))
    close(client.post("/embed", json={"inputs": texts, "input_type": "document"}).json(),
          ref.encode_document(texts, **enc))
    # a name wins over input_type, as an explicit prompt_name wins in encode_query
    close(embeddings(client, texts, input_type="query", prompt_name="document"),
          ref.encode_query(texts, prompt_name="document", **enc))


def test_score_on_an_embedder_is_query_against_document(served):
    client, ref = served
    query, docs = "how to open a file", ["open() returns a file object", "integer division", "x"]
    body = client.post("/v1/score", json={"text_1": query, "text_2": docs})
    assert body.status_code == 200, body.text
    got = torch.tensor([d["score"] for d in body.json()["data"]])
    q = torch.nn.functional.normalize(ref.encode_query([query], convert_to_tensor=True), dim=-1)
    d = torch.nn.functional.normalize(ref.encode_document(docs, convert_to_tensor=True), dim=-1)
    assert torch.allclose(got, (q @ d.T)[0], atol=1e-4), got


@pytest.mark.parametrize("body", [{"prompt_name": "nope"}, {"prompt_name": "QUERY"}, {"prompt_name": 5},
                                  {"input_type": "passage"}, {"input_type": ["query"]}, {"prompt_name": ""}])
def test_bad_prompt_names_are_422(served, body):
    client, _ = served
    for route, key in (("/embed", "inputs"), ("/v1/embeddings", "input")):
        response = client.post(route, json={key: "a text", **body})
        assert_422(response)
