"""The pooling routes in-process (Starlette TestClient, the real PoolingEngine on tiny checkpoints): rerank order
against sentence-transformers' CrossEncoder, /predict and /v1/score shapes, Matryoshka `dimensions`, base64,
hostile and malformed inputs answered with TGI's 422 body, and the wrong task refused both ways."""
from __future__ import annotations

import base64
import struct

import pytest

torch = pytest.importorskip("torch")
st = pytest.importorskip("sentence_transformers")

from starlette.testclient import TestClient  # noqa: E402

from engine.async_engine import AsyncEngine  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.pooling.engine import PoolingEngine  # noqa: E402
from engine.server.app import build_app  # noqa: E402
from test_pooling_models import mixed_texts  # noqa: E402

QUERY = "how do I open a file for reading"
DOCS = ["open() returns a file object; mode 'r' opens for reading", "the with statement", "lambda expressions",
        "Reading and writing files: f = open('workfile', encoding='utf-8')", "integer division", "x"]


@pytest.fixture(scope="module")
def app_for(model_path):
    engines = []

    def build(name: str, engine=None, **overrides) -> TestClient:
        config = EngineConfig(model_id=str(model_path(name)) if name else "fake", device="cpu",
                              served_model_name=name or "fake", **overrides)
        engine = AsyncEngine(engine or PoolingEngine(config)).start()
        engines.append(engine)
        return TestClient(build_app(engine, config))
    yield build
    for engine in engines:
        engine.close()


@pytest.fixture(scope="module")
def cross(app_for):
    return app_for("tiny-bert-cross")


@pytest.fixture(scope="module")
def embedder(app_for):
    return app_for("tiny-bert-embed", max_client_batch_size=8)


def assert_422(response, *needles: str) -> str:
    assert response.status_code == 422, response.text
    body = response.json()
    assert set(body) == {"error", "error_type"} and body["error_type"] == "validation", body
    assert "Traceback" not in body["error"]
    for needle in needles:
        assert needle in body["error"], body["error"]
    return body["error"]


def test_rerank_order_equals_cross_encoder(cross, model_path):
    ref = st.CrossEncoder(str(model_path("tiny-bert-cross")), device="cpu")
    want = [r["corpus_id"] for r in ref.rank(QUERY, DOCS)]
    want_scores = {r["corpus_id"]: r["score"] for r in ref.rank(QUERY, DOCS)}
    tei = cross.post("/rerank", json={"query": QUERY, "texts": DOCS, "return_text": True})
    assert tei.status_code == 200, tei.text
    assert [r["index"] for r in tei.json()] == want
    assert all(r["text"] == DOCS[r["index"]] for r in tei.json())
    assert all(abs(r["score"] - want_scores[r["index"]]) < 1e-4 for r in tei.json())
    cohere = cross.post("/v1/rerank", json={"query": QUERY, "documents": [{"text": d} for d in DOCS], "top_n": 3})
    assert cohere.status_code == 200, cohere.text
    body = cohere.json()
    assert [r["index"] for r in body["results"]] == want[:3]
    assert body["results"][0]["document"] == {"text": DOCS[want[0]]} and body["usage"]["total_tokens"] > 0
    score = cross.post("/v1/score", json={"text_1": QUERY, "text_2": DOCS}).json()
    assert [round(d["score"], 5) for d in score["data"]] == [round(want_scores[i], 5) for i in range(len(DOCS))]


def test_predict_single_pair_and_batch(cross):
    single = cross.post("/predict", json={"inputs": "a text"}).json()
    assert len(single) == 1 and single[0]["label"] == "LABEL_0" and 0 < single[0]["score"] < 1
    pair = cross.post("/predict", json={"inputs": [QUERY, DOCS[0]], "raw_scores": True}).json()
    batch = cross.post("/predict", json={"inputs": [[QUERY, DOCS[0]], [QUERY, DOCS[1]]], "raw_scores": True}).json()
    assert len(batch) == 2 and abs(batch[0][0]["score"] - pair[0]["score"]) < 1e-5
    assert_422(cross.post("/predict", json={"inputs": [["a", "b", "c"]]}), "pair")
    assert_422(cross.post("/predict", json={"inputs": [["a", "b"], ["c"]]}), "only texts or only pairs")


def test_embed_dimensions_base64_and_prompts(embedder):
    text = "The with statement wraps the execution of a block with methods defined by a context manager."
    full = torch.tensor(embedder.post("/v1/embeddings", json={"input": text}).json()["data"][0]["embedding"])
    assert abs(full.norm().item() - 1) < 1e-5  # the checkpoint has a Normalize module
    short = embedder.post("/v1/embeddings", json={"input": [text], "dimensions": 8}).json()["data"][0]["embedding"]
    assert len(short) == 8
    assert torch.allclose(torch.tensor(short), torch.nn.functional.normalize(full[:8], dim=0), atol=1e-5)
    b64 = embedder.post("/v1/embeddings", json={"input": text, "encoding_format": "base64"}).json()
    raw = base64.b64decode(b64["data"][0]["embedding"])
    assert torch.allclose(torch.tensor(struct.unpack(f"<{len(raw) // 4}f", raw)), full, atol=1e-6)
    tokens = embedder.post("/tokenize", json={"inputs": text}).json()
    ids = embedder.post("/v1/embeddings", json={"input": [[t["id"] for t in tokens]]}).json()
    assert torch.allclose(torch.tensor(ids["data"][0]["embedding"]), full, atol=1e-5)
    assert ids["usage"] == {"prompt_tokens": len(tokens), "total_tokens": len(tokens)}
    tei = embedder.post("/embed", json={"inputs": [text, "x"], "normalize": False}).json()
    assert len(tei) == 2 and abs(torch.tensor(tei[0]).norm().item() - 1) > 1e-3  # TEI's normalize=false
    # sentence-transformers 6 gives every model empty "query" and "document" prompts; other names are unknown
    assert embedder.post("/embed", json={"inputs": "x", "prompt_name": "query"}).json() == \
        embedder.post("/embed", json={"inputs": "x"}).json()
    assert_422(embedder.post("/embed", json={"inputs": "x", "prompt_name": "passage"}), "prompt_name", "document")


def test_too_long_is_422_unless_truncated(embedder):
    long = " ".join(["word"] * 400)
    assert_422(embedder.post("/v1/embeddings", json={"input": long}), "128", "truncate")
    assert_422(embedder.post("/embed", json={"inputs": long}), "128")
    assert embedder.post("/embed", json={"inputs": long, "truncate": True}).status_code == 200
    right = embedder.post("/v1/embeddings", json={"input": long, "truncate": True}).json()
    assert right["usage"]["prompt_tokens"] == 128
    tei = embedder.post("/embed", json={"inputs": long, "truncate": True}).json()[0]
    assert torch.allclose(torch.tensor(right["data"][0]["embedding"]), torch.tensor(tei), atol=1e-5)
    left = embedder.post("/v1/embeddings", json={"input": long, "truncate_prompt_tokens": 16}).json()
    assert left["usage"]["prompt_tokens"] == 16


@pytest.mark.parametrize("body", [
    {"input": ""}, {"input": []}, {"input": ["ok", ""]}, {"input": [[]]}, {"input": 5}, {"input": None},
    {"input": ["a", 1]}, {"input": [[1, -1]]}, {"input": [[1, 10**9]]}, {"input": {"text": "a"}},
    {"input": ["x"] * 9}, {"input": "a", "dimensions": 0}, {"input": "a", "dimensions": 100000},
    {"input": "a", "encoding_format": "int8"}, {"input": "a", "truncate_prompt_tokens": 0},
    {"input": "a", "truncate_prompt_tokens": 100000}, {"input": "\u0000$(touch /tmp/pwned)", "dimensions": "8"},
], ids=repr)
def test_hostile_embedding_inputs_are_422(embedder, body):
    assert_422(embedder.post("/v1/embeddings", json=body))


@pytest.mark.parametrize("route,body", [
    ("/embed", {"inputs": ""}), ("/embed", {"inputs": ["x"] * 9}), ("/embed", {"inputs": [None]}),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}), ("/v1/score", {"text_1": "", "text_2": "a"}),
    ("/v1/rerank", {"query": "q", "documents": []}), ("/v1/rerank", {"query": "", "documents": ["a"]}),
    ("/v1/embeddings", b"{not json"), ("/embed", b"\xff\xfe"),
], ids=repr)
def test_hostile_inputs_on_every_route_are_422(embedder, route, body):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    assert_422(embedder.post(route, **kwargs))


def test_embedder_scores_by_cosine(embedder):
    body = embedder.post("/v1/score", json={"text_1": ["same text", "same text"],
                                            "text_2": ["same text", "other"]}).json()
    assert abs(body["data"][0]["score"] - 1) < 1e-5 and body["data"][1]["score"] < 0.9999


def test_wrong_task_names_the_routes_served(embedder, cross, app_for):
    from test_server import FakeEngine
    assert_422(embedder.post("/generate", json={"inputs": "x"}), "/v1/embeddings")
    assert_422(embedder.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}),
               "/v1/embeddings")
    assert_422(embedder.post("/predict", json={"inputs": "x"}), "cross-encoder", "/v1/embeddings")
    assert_422(cross.post("/v1/embeddings", json={"input": "x"}), "embedding", "/rerank")
    assert_422(cross.post("/v1/completions", json={"prompt": "x"}), "/rerank")
    generative = app_for(None, engine=FakeEngine())
    for route, body in [("/v1/embeddings", {"input": "x"}), ("/embed", {"inputs": "x"}),
                        ("/rerank", {"query": "q", "texts": ["a"]}), ("/v1/score", {"text_1": "a", "text_2": "b"})]:
        assert_422(generative.post(route, json=body), "text generation", "/v1/chat/completions")
    assert generative.get("/info").json()["task"] == "generate"
    assert embedder.get("/info").json()["task"] == "embed"
    assert embedder.get("/info").json()["model_pipeline_tag"] == "feature-extraction"
    assert cross.get("/v1/models").json()["data"][0]["task"] == "classify"


def test_post_root_is_teis_task_route(embedder, cross):
    assert len(embedder.post("/", json={"inputs": ["a", "b"]}).json()) == 2
    assert cross.post("/", json={"inputs": "a"}).json()[0]["label"] == "LABEL_0"
