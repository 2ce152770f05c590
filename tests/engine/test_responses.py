"""OpenAI's Responses API against the real launcher on tiny-llama with the real `openai` client
(`client.responses.create`, streamed and not): text, `text.format` json_schema validated, function tools and
their outputs sent back, previous_response_id (and its bounded store), usage, and the 422s that name what this
server does not do."""
from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("torch")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from test_clients import assert_all_blocks_free, start_server, stop_server  # noqa: E402

from engine.server.response_store import ResponseStore  # noqa: E402

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "legs": {"type": "integer", "minimum": 0, "maximum": 8}},
          "required": ["name", "legs"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    proc, url, log = start_server(model_path("tiny-llama"), tmp_path_factory.mktemp("responses"))
    yield url
    try:
        assert_all_blocks_free(url)
    finally:
        stop_server(proc)
        assert "Traceback" not in log.read_text()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", timeout=60, max_retries=0)


def test_text_streamed_and_not_agree(client):
    kwargs = dict(model="tiny", input="Say something", instructions="Be terse.", max_output_tokens=10,
                  temperature=0)
    response = client.responses.create(**kwargs)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output[0].type == "message" and response.output_text
    assert response.status in ("completed", "incomplete")
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"
    usage = response.usage
    assert 0 < usage.output_tokens <= 10 and usage.total_tokens == usage.input_tokens + usage.output_tokens
    events = list(client.responses.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == response.output_text == events[-1].response.output_text       # greedy: the same text
    assert events[-1].response.usage.output_tokens == usage.output_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_validates(client, stream):
    fmt = {"format": {"type": "json_schema", "name": "animal", "schema": SCHEMA, "strict": True}}
    for seed in range(3):
        kwargs = dict(model="tiny", input="An animal as JSON", text=fmt, max_output_tokens=60, temperature=1.0,
                      extra_body={"seed": seed})
        if stream:
            final = [e for e in client.responses.create(**kwargs, stream=True)][-1].response
        else:
            final = client.responses.create(**kwargs)
        assert final.status == "completed", final.output_text
        jsonschema.validate(json.loads(final.output_text), SCHEMA)


@pytest.mark.parametrize("stream", [False, True])
def test_function_call_and_its_output_sent_back(client, stream):
    kwargs = dict(model="tiny", input="What is the weather in Paris?", tools=[WEATHER], tool_choice="required",
                  parallel_tool_calls=False, max_output_tokens=80, temperature=0)
    if stream:
        events = list(client.responses.create(**kwargs, stream=True))
        first = events[-1].response
        arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        assert arguments == first.output[0].arguments
    else:
        first = client.responses.create(**kwargs)
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    # the result goes back through previous_response_id, and statelessly with the call itself in the input
    follow = [{"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees, sunny"}]
    chained = client.responses.create(model="tiny", previous_response_id=first.id, input=follow, tools=[WEATHER],
                                      max_output_tokens=8, temperature=0)
    assert chained.previous_response_id == first.id and chained.output[0].type == "message"
    stateless = client.responses.create(model="tiny", input=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        *follow], tools=[WEATHER], max_output_tokens=8, temperature=0)
    assert stateless.output_text == chained.output_text          # the same conversation, the same greedy answer
    assert stateless.usage.input_tokens == chained.usage.input_tokens


def test_previous_response_carries_the_conversation(client):
    first = client.responses.create(model="tiny", input="My name is Ada.", max_output_tokens=4, temperature=0)
    second = client.responses.create(model="tiny", input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=4, temperature=0)
    alone = client.responses.create(model="tiny", input="What is my name?", max_output_tokens=4, temperature=0)
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
    unstored = client.responses.create(model="tiny", input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        client.responses.create(model="tiny", input="again", previous_response_id=unstored.id, max_output_tokens=2)
    assert "`previous_response_id`" in str(refused.value.body)     # the client keeps our `error` text


def test_the_store_is_bounded():
    store = ResponseStore(max_entries=2)
    for i in range(3):
        store.put(f"r{i}", [{"role": "user", "content": str(i)}])
    assert store.get("r0") is None and len(store) == 2
    store.get("r1")             # used: kept over r2
    store.put("r3", [])
    assert store.get("r2") is None and store.get("r1") is not None


@pytest.mark.parametrize("extra, field", [
    ({"tools": [{"type": "web_search"}]}, "`tools[0].type` 'web_search'"),
    ({"background": True}, "`background`"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "`input[0].content[0].type` 'input_image'"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file-1"}]}]},
     "`input[0].content[0].type` 'input_file'"),
    ({"input": [{"type": "file_search_call", "id": "x"}]}, "`input[0].type` 'file_search_call'"),
    ({"conversation": "conv_1"}, "`conversation`"),
    ({"reasoning": {"effort": "high"}}, "`reasoning`"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objekt"}}}}, "json_schema.schema"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "'nope' is not in `tools`"),
    ({"max_output_tokens": 10**6}, "max_new_tokens"),
    ({"input": []}, "`input` must hold at least one item"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "objekt"}}]}, "`tools[0].function.parameters`"),
])
def test_unsupported_features_are_422_naming_the_field(server, extra, field):
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 4, **extra}
    r = httpx.post(f"{server}/v1/responses", json=body, timeout=60)
    assert r.status_code == 422, r.text
    assert field in r.json()["error"] and r.json()["error_type"] == "validation"
