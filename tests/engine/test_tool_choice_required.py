"""Issue 25: `tool_choice: "required"` once answered without a tool call (SmolLM2, the `openai` client, default
sampling, after a `parse` and a `json_object` request on a fresh server). The same sequence on a fresh SmolLM2
server, then "required" with many seeds at the default temperature, streamed and not: every answer is a call
whose arguments validate."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("torch")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pydantic = pytest.importorskip("pydantic")

from test_clients import assert_all_blocks_free, start_server, stop_server  # noqa: E402

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What's the weather like in Paris today?"}]
SEEDS = 12


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=16)
    age: int = pydantic.Field(ge=0, le=120)


@pytest.fixture(scope="module")
def oai(model_path, tmp_path_factory):
    proc, url, log = start_server(model_path("smollm2"), tmp_path_factory.mktemp("required"),
                                  "--max-concurrent-requests", "64")
    try:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=300, max_retries=0)
        assert_all_blocks_free(url)
    finally:
        stop_server(proc)


@pytest.mark.timeout(1200)
def test_required_always_calls_after_parse_and_json_object(oai):
    oai.chat.completions.parse(model="tgi", messages=[{"role": "user", "content": "Marie is 34. As JSON."}],
                               response_format=Person, max_tokens=60)
    oai.chat.completions.create(model="tgi", messages=[{"role": "user", "content": "Any JSON object, please."}],
                                response_format={"type": "json_object"}, max_tokens=60)

    def ask(seed: int):
        if seed % 2:    # streamed: the call's pieces reassembled
            chunks = list(oai.chat.completions.create(model="tgi", messages=ASK, tools=[WEATHER],
                                                      tool_choice="required", seed=seed, stream=True))
            calls = [c for chunk in chunks for d in chunk.choices for c in d.delta.tool_calls or []]
            finish = [d.finish_reason for chunk in chunks for d in chunk.choices if d.finish_reason]
            return finish, [(calls[0].function.name if calls else None,
                             "".join(c.function.arguments or "" for c in calls))] if calls else []
        choice = oai.chat.completions.create(model="tgi", messages=ASK, tools=[WEATHER], tool_choice="required",
                                             seed=seed).choices[0]
        return [choice.finish_reason], [(c.function.name, c.function.arguments)
                                        for c in choice.message.tool_calls or []]

    with ThreadPoolExecutor(SEEDS) as pool:
        answers = list(pool.map(ask, range(SEEDS)))
    for seed, (finish, calls) in enumerate(answers):
        assert finish == ["tool_calls"] and len(calls) == 1, (seed, finish, calls)
        name, arguments = calls[0]
        assert name == "get_weather"
        jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])
