"""Embedding a JSONL corpus: ids and order kept, batches of --batch-size, bad lines refused before any request,
nothing left at the target when a run fails (no torch)."""
from __future__ import annotations

import json

import httpx
import pytest

from tgi_hpc.service.client import ServiceClient
from tgi_hpc.workflows.embed_corpus import embed_jsonl, main


def fake_client(calls: list[int], fail_at: int | None = None) -> ServiceClient:
    def handler(request: httpx.Request) -> httpx.Response:
        texts = json.loads(request.content)["input"]
        calls.append(len(texts))
        if fail_at is not None and len(calls) == fail_at:
            return httpx.Response(422, json={"error": "too long", "error_type": "validation"})
        return httpx.Response(200, json={"data": [{"index": i, "embedding": [float(len(t))]}
                                                  for i, t in enumerate(texts)]})
    client = ServiceClient(urls=["http://replica:1"], retry_for=0)
    client._http = httpx.Client(transport=httpx.MockTransport(handler))
    return client


def test_corpus_is_embedded_in_order_with_ids(tmp_path):
    source = tmp_path / "corpus.jsonl"
    lines = [{"id": "a", "text": "x"}, {"text": "yy"}, {}, {"id": 7, "text": "zzz"}, {"text": "$(touch pwned)"}]
    source.write_text("\n".join(json.dumps(r) for r in lines if r) + "\n\n")
    calls: list[int] = []
    target = tmp_path / "out.jsonl"
    assert embed_jsonl(fake_client(calls), source, target, batch_size=2, progress=False) == 4
    assert calls == [2, 2]
    out = [json.loads(line) for line in target.read_text().splitlines()]
    assert out == [{"id": "a", "embedding": [1.0]}, {"id": 2, "embedding": [2.0]}, {"id": 7, "embedding": [3.0]},
                   {"id": 4, "embedding": [14.0]}]
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("content,message", [("{not json\n", ":1: not JSON"), ('{"text": ""}\n', ":1: no non-empty"),
                                             ('{"text": "ok"}\n[1, 2]\n', ":2: no non-empty"),
                                             ('{"body": "x"}\n', "'text'")])
def test_bad_lines_are_refused_before_any_request(tmp_path, content, message):
    source = tmp_path / "corpus.jsonl"
    source.write_text(content)
    calls: list[int] = []
    with pytest.raises(ValueError, match=message):
        embed_jsonl(fake_client(calls), source, tmp_path / "out.jsonl", progress=False)
    assert calls == [] and not (tmp_path / "out.jsonl").exists()


def test_a_failed_run_leaves_no_target(tmp_path, capsys):
    source = tmp_path / "corpus.jsonl"
    source.write_text("".join(json.dumps({"text": f"t{i}"}) + "\n" for i in range(5)))
    with pytest.raises(httpx.HTTPStatusError):
        embed_jsonl(fake_client([], fail_at=2), source, tmp_path / "out.jsonl", batch_size=2, progress=False)
    assert list(tmp_path.iterdir()) == [source]  # no target, no partial file
    assert main([str(tmp_path / "missing.jsonl"), str(tmp_path / "o.jsonl"), "--url", "http://127.0.0.1:9"]) == 1
    assert "error:" in capsys.readouterr().err


def test_prompt_choice_reaches_each_request(tmp_path):
    source = tmp_path / "corpus.jsonl"
    source.write_text("".join(json.dumps({"id": i, "text": f"t{i}"}) + "\n" for i in range(3)))
    bodies: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        bodies.append(body)
        return httpx.Response(200, json={"data": [{"index": i, "embedding": [0.0]} for i in range(len(body["input"]))]})
    client = ServiceClient(urls=["http://replica:1"], retry_for=0)
    client._http = httpx.Client(transport=httpx.MockTransport(handler))
    embed_jsonl(client, source, tmp_path / "docs.jsonl", batch_size=2, progress=False,
                prompt={"input_type": "document"})
    embed_jsonl(client, source, tmp_path / "plain.jsonl", batch_size=5, progress=False)
    assert [(b.get("input_type"), b.get("prompt_name"), len(b["input"])) for b in bodies] == [
        ("document", None, 2), ("document", None, 1), (None, None, 3)]  # nothing sent when nothing was chosen
    with pytest.raises(SystemExit):
        main([str(source), str(tmp_path / "o.jsonl"), "--url", "http://127.0.0.1:9", "--input-type", "passage"])
