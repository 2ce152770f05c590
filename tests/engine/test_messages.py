"""Anthropic's Messages API against the real launcher on tiny-llama with the real `anthropic` client: text,
streaming events, stop sequences, tools (forced call, the schema validated, tool results sent back),
count_tokens, x-api-key and Bearer auth, and refusals in Anthropic's error body."""
from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("torch")
anthropic = pytest.importorskip("anthropic")
jsonschema = pytest.importorskip("jsonschema")

from test_clients import API_KEY, assert_all_blocks_free, start_server, stop_server  # noqa: E402

WEATHER = {"name": "get_weather", "description": "Current weather in a city", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    proc, url, log = start_server(model_path("tiny-llama"), tmp_path_factory.mktemp("messages"),
                                  env={"API_KEY": API_KEY})
    yield url
    try:
        assert_all_blocks_free(url)
    finally:
        stop_server(proc)
        assert "Traceback" not in log.read_text()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server, api_key=API_KEY, timeout=60, max_retries=0)


def test_text_streamed_and_not_agree(client):
    kwargs = dict(model="tiny", max_tokens=12, extra_body={"temperature": 0}, system="You are terse.",
                  messages=[{"role": "user", "content": [{"type": "text", "text": "Say something"}]}])
    message = client.messages.create(**kwargs)
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [b.type for b in message.content] == ["text"] and message.content[0].text
    assert message.stop_reason in ("max_tokens", "end_turn")
    assert message.usage.output_tokens <= 12
    assert message.usage.input_tokens == client.messages.count_tokens(
        model="tiny", system="You are terse.", messages=kwargs["messages"]).input_tokens
    with client.messages.stream(**kwargs) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.content[0].text == message.content[0].text          # greedy: the same text
    assert final.stop_reason == message.stop_reason and final.usage.output_tokens == message.usage.output_tokens
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "content_block_stop", "message_delta"} <= set(events)


def test_stop_sequences(client):
    kwargs = dict(model="tiny", max_tokens=16, extra_body={"temperature": 0}, messages=USER)
    text = client.messages.create(**kwargs).content[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip(), text
    message = client.messages.create(**kwargs, stop_sequences=["\x00never", stop])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].text == text[:text.index(stop)]


@pytest.mark.parametrize("seed", range(3))
def test_forced_tool_call_validates(client, seed):
    message = client.messages.create(model="tiny", max_tokens=80, tools=[WEATHER], messages=USER,
                                      tool_choice={"type": "any", "disable_parallel_tool_use": True}, metadata={"user_id": f"seed-{seed}"})
    assert message.stop_reason == "tool_use", message.content
    [block] = message.content
    assert block.type == "tool_use" and block.name == "get_weather" and block.id.startswith("toolu_")
    jsonschema.validate(block.input, WEATHER["input_schema"])


def test_streamed_tool_call(client):
    with client.messages.stream(model="tiny", max_tokens=80, extra_body={"temperature": 0}, tools=[WEATHER],
                                messages=USER, tool_choice={"type": "tool", "name": "get_weather",
                                                            "disable_parallel_tool_use": True}) as stream:
        deltas = [e.delta.partial_json for e in stream if e.type == "content_block_delta"
                  and e.delta.type == "input_json_delta"]
        final = stream.get_final_message()
    [block] = final.content
    assert final.stop_reason == "tool_use" and block.type == "tool_use"
    assert json.loads("".join(deltas)) == block.input
    jsonschema.validate(block.input, WEATHER["input_schema"])


def test_tool_results_reach_the_prompt(client):
    def count(result: str) -> int:
        messages = USER + [
            {"role": "assistant", "content": [{"type": "text", "text": "Let me check."}, {
                "type": "tool_use", "id": "toolu_1", "name": "get_weather",
                "input": {"city": "Paris", "unit": "celsius"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                          "content": [{"type": "text", "text": result}]}]}]
        return client.messages.count_tokens(model="tiny", tools=[WEATHER], messages=messages).input_tokens
    assert count("18 degrees and sunny over the whole city today") > count("18")
    answer = client.messages.create(model="tiny", max_tokens=8, tools=[WEATHER], messages=USER + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris", "unit": "celsius"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"}]}],
        tool_choice={"type": "none"})
    assert answer.content[0].type == "text" and answer.stop_reason in ("max_tokens", "end_turn")


def test_auth_x_api_key_and_bearer(server):
    wrong = anthropic.Anthropic(base_url=server, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.create(model="tiny", max_tokens=2, messages=USER)
    body = {"model": "tiny", "max_tokens": 2, "messages": USER}
    r = httpx.post(f"{server}/v1/messages", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert r.status_code == 200 and r.json()["type"] == "message"
    r = httpx.post(f"{server}/v1/chat/completions", json={"messages": USER, "max_tokens": 2},
                   headers={"x-api-key": API_KEY}, timeout=60)
    assert r.status_code == 200
    r = httpx.post(f"{server}/v1/messages", json=body,
                   headers={"x-api-key": "wrong", "Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert r.status_code == 401


@pytest.mark.parametrize("body, message", [
    ({"messages": USER}, "max_tokens"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]},
     "this model is text-only: it takes no images"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_use", "name": "x", "input": {}}]}]},
     "`messages[0].content[0].type` 'tool_use' is not supported in a user message"),
    ({"max_tokens": 4, "messages": USER, "thinking": {"type": "enabled", "budget_tokens": 1024}}, "`thinking`"),
    ({"max_tokens": 4, "messages": USER, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}},
     "'nope' is not in `tools`"),
    ({"max_tokens": 4, "messages": USER, "tool_choice": {"type": "sometimes"}}, "`tool_choice` must be"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
     "`messages[0].content[0].tool_use_id` is required"),
    ({"max_tokens": 4, "system": [{"type": "image"}], "messages": USER}, "`system[0]` must be a text block"),
    ({"max_tokens": 10**6, "messages": USER}, "max_new_tokens"),
])
def test_refusals_use_anthropics_error_body(server, client, body, message):
    r = httpx.post(f"{server}/v1/messages", json={"model": "tiny", **body}, headers={"x-api-key": API_KEY},
                   timeout=60)
    assert r.status_code == 422, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert message in error["error"]["message"], error
    with pytest.raises(anthropic.UnprocessableEntityError):
        client.messages.create(model="tiny", **body) if "max_tokens" in body else \
            client.messages.create(model="tiny", max_tokens=None, **body)  # type: ignore[arg-type]


def test_a_stream_that_fails_ends_with_an_error_event():
    # FakeEngine: a prompt containing FAIL gets a per-request engine error once the stream is open
    from starlette.testclient import TestClient
    from test_server import make_app
    app, engine, _ = make_app()
    try:
        with TestClient(app) as client:
            with client.stream("POST", "/v1/messages", json={"max_tokens": 4, "stream": True, "messages": [
                    {"role": "user", "content": "FAIL please"}]}) as r:
                lines = [line for line in r.iter_lines() if line]
            assert r.status_code == 200
            assert lines[0] == "event: message_start" and lines[-2] == "event: error", lines
            error = json.loads(lines[-1].removeprefix("data: "))
            assert error["type"] == "error" and error["error"]["type"] == "api_error"
            assert "CUDA out of memory" in error["error"]["message"]
            with client.stream("POST", "/v1/responses", json={"input": "FAIL", "stream": True}) as r:
                lines = [line for line in r.iter_lines() if line]
            assert lines[-2] == "event: error" and "CUDA out of memory" in lines[-1], lines
    finally:
        engine.close()
