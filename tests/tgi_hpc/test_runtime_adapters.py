"""`tgi-hpc adapter`'s parts that need no cluster: NAME=PATH refused in one line, the service's adapter record
(damaged files list nothing), the server's answers turned into the toolkit's errors (a 4xx is the caller's, a 5xx
or no answer is not), and a successor loading the record (an adapter already there counts, a refused one is left
out). The commands against a real engine in a Slurm job: tests/cluster/test_serve_several_models.py."""
from __future__ import annotations

import json

import httpx
import pytest

from tgi_hpc.errors import TgiHpcError, UsageError
from tgi_hpc.service import adapters
from tgi_hpc.workflows.runtime_adapters import parse_item

URL = "http://node:8080"


@pytest.mark.parametrize("item, message", [
    ("ckpt", "expected NAME=PATH"),
    ("=/scratch/a", "expected NAME=PATH"),
    ("ckpt=", "expected NAME=PATH"),
    ("a b=/scratch/a", "use 1-64 letters"),
    ("../up=/scratch/a", "use 1-64 letters"),
    ("x;rm -rf ~=/scratch/a", "use 1-64 letters"),
    ("tgi=/scratch/a", "means the base model"),
])
def test_bad_items_are_refused_in_one_line(item, message):
    with pytest.raises(UsageError, match=message) as info:
        parse_item(item)
    assert "\n" not in str(info.value)


def test_a_good_item_keeps_its_path():
    assert parse_item("ckpt-1.5=/scratch/run/checkpoint=1") == ("ckpt-1.5", "/scratch/run/checkpoint=1")


def test_the_record_round_trips_and_a_damaged_one_lists_nothing():
    record = {"b": "/x/b", "a": "/x/a"}
    assert adapters.parse_record(adapters.record_text(record)) == record
    for damaged in ("", "{", "[]", '{"adapters": [1]}', '{"adapters": {"a": 3, "b": "/x/b"}}', "null"):
        assert adapters.parse_record(damaged) in ({}, {"b": "/x/b"})
    assert adapters.record_path("/jobs/services/svc.json") == "/jobs/services/svc.adapters.json"


def _server(answers: dict[str, tuple[int, object]], seen: list | None = None) -> httpx.MockTransport:
    """Answers by lora_name: (status, JSON body or text)."""
    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content or b"{}")
        if seen is not None:
            seen.append((request.url.path, body, request.headers.get("authorization")))
        status, answer = answers[body.get("lora_name", "")]
        if isinstance(answer, str):
            return httpx.Response(status, text=answer)
        return httpx.Response(status, json=answer)
    return httpx.MockTransport(handle)


@pytest.mark.parametrize("status, answer, kind, message", [
    (422, {"error": "no free LoRA slot: 2 of --max-loras 2 are taken", "error_type": "validation"},
     adapters.AdapterRefused, "422: no free LoRA slot"),
    (404, {"error": "loading LoRA adapters at run time is off on this server", "error_type": "not_found"},
     adapters.AdapterRefused, "is off on this server"),
    (401, {"error": "Unauthorized", "error_type": "authentication"}, adapters.AdapterRefused, "API key was refused"),
    (500, {"error": "boom", "error_type": "generation"}, TgiHpcError, "500: boom"),
    (502, "<html>Bad Gateway</html>", TgiHpcError, "502: <html>Bad Gateway</html>"),
])
def test_the_server_answers_become_one_line_errors(status, answer, kind, message):
    transport = _server({"a": (status, answer)})
    with pytest.raises(TgiHpcError, match=message) as info:
        adapters.load(URL, {}, "a", "/x/a", transport=transport)
    assert type(info.value) is kind and "\n" not in str(info.value)
    assert isinstance(info.value, UsageError) == (status < 500)


def test_no_answer_is_a_connection_error():
    def refuse(request):
        raise httpx.ConnectError("connection refused")
    with pytest.raises(TgiHpcError, match="cannot reach http://node:8080") as info:
        adapters.unload(URL, {}, "a", transport=httpx.MockTransport(refuse))
    assert not isinstance(info.value, UsageError)


def test_a_successor_loads_the_record_once(tmp_path):
    record = tmp_path / "svc.adapters.json"
    record.write_text(adapters.record_text({"a": "/x/a", "b": "/x/b", "gone": "/x/gone"}))
    seen: list = []
    transport = _server({"a": (200, "Success"), "b": (422, {"error": "'b' is already loaded"}),
                         "gone": (422, {"error": "adapter folder /x/gone: no such directory"})}, seen)
    loaded: set[str] = set()
    assert adapters.load_recorded(URL, "key", record, loaded, transport=transport) == ["a", "b"]
    assert loaded == {"a", "b"}
    assert seen[0] == ("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/x/a"}, "Bearer key")
    seen.clear()
    assert adapters.load_recorded(URL, "key", record, loaded, transport=transport) == []
    assert [body["lora_name"] for _, body, _ in seen] == ["gone"]      # tried again; the loaded ones are not
    assert adapters.load_recorded(URL, None, tmp_path / "none.json", set(), transport=transport) == []
