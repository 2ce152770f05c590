"""ServiceClient.embed: batches of /v1/embeddings, vectors back in input order, errors raised (no torch)."""
from __future__ import annotations

import inspect
import json

import httpx
import pytest

from tgi_hpc import api
from tgi_hpc.service.client import ServiceClient


def client_with(handler) -> ServiceClient:
    client = ServiceClient(urls=["http://replica:1"], retry_for=0)
    client._http = httpx.Client(transport=httpx.MockTransport(handler))
    return client


def test_embed_batches_and_keeps_order():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append((request.url.path, len(body["input"]), body.get("dimensions")))
        data = [{"object": "embedding", "index": i, "embedding": [float(len(t))]} for i, t in enumerate(body["input"])]
        return httpx.Response(200, json={"data": list(reversed(data))})  # any order on the wire

    texts = ["a" * n for n in range(1, 8)]
    assert client_with(handler).embed(texts, batch_size=3, dimensions=4) == [[float(n)] for n in range(1, 8)]
    assert seen == [("/v1/embeddings", 3, 4), ("/v1/embeddings", 3, 4), ("/v1/embeddings", 1, 4)]


def test_embed_raises_the_servers_422():
    answer = {"error": "Input validation error: `input` is empty", "error_type": "validation"}
    client = client_with(lambda request: httpx.Response(422, json=answer))
    with pytest.raises(httpx.HTTPStatusError):
        client.embed("")
    with pytest.raises(ValueError, match="batch_size"):
        client.embed(["a"], batch_size=0)


def test_embed_sends_the_prompt_choice_only_when_made():
    bodies = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(200, json={"data": [{"index": 0, "embedding": [1.0]}]})
    client = client_with(handler)
    client.embed("a", input_type="query")
    client.embed("a", prompt_name="clustering")
    client.embed("a")
    assert [(b.get("input_type"), b.get("prompt_name")) for b in bodies] == [
        ("query", None), (None, "clustering"), (None, None)]
    assert {"prompt_name", "input_type"} <= set(inspect.signature(api.embed).parameters)
