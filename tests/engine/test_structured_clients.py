"""Structured output end to end: the real server on SmolLM2 against the real `openai`, `text-generation` and
`huggingface_hub` clients; every answer is checked with `jsonschema` (or the pydantic model, or the regex)."""
from __future__ import annotations

import asyncio
import enum
import json
import re
from typing import Annotated, Literal, Optional

import httpx
import pytest

pytest.importorskip("torch")
jsonschema = pytest.importorskip("jsonschema")
text_generation = pytest.importorskip("text_generation")
huggingface_hub = pytest.importorskip("huggingface_hub")
openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")
from pydantic import BaseModel, Field  # noqa: E402

from test_clients import assert_all_blocks_free, start_server, stop_server  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:The `dict` method is deprecated")]

# the TGI workshop's grammar example
WORKSHOP_PROMPT = "I saw a puppy a cat and a raccoon during my bike ride in the park"
WORKSHOP_SCHEMA = {
    "properties": {
        "location": {"title": "Location", "type": "string", "maxLength": 30},
        "activity": {"title": "Activity", "type": "string", "maxLength": 30},
        "animals_seen": {"maximum": 5, "minimum": 1, "title": "Animals Seen", "type": "integer"},
        "animals": {"items": {"type": "string", "maxLength": 12}, "title": "Animals", "type": "array",
                    "maxItems": 4},
    },
    "required": ["location", "activity", "animals_seen", "animals"],
    "title": "Animals",
    "type": "object",
}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
SEARCH_TOOL = {"type": "function", "function": {
    "name": "search", "description": "Search the web",
    "parameters": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 30},
                                                    "max_results": {"type": "integer", "minimum": 1, "maximum": 10}},
                   "required": ["query", "max_results"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    proc, url, _ = start_server(model_path("smollm2"), tmp_path_factory.mktemp("structured"),
                                "--max-concurrent-requests", "128")
    yield url
    try:
        assert_all_blocks_free(url)
    finally:
        stop_server(proc)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", timeout=120)


# --- openai SDK: response_format=<pydantic model> ------------------------------------------------------

class Color(str, enum.Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Address(BaseModel):
    city: str = Field(max_length=16)
    country: Literal["France", "Canada", "Japan"]


class Person(BaseModel):
    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=120)
    address: Address


class Palette(BaseModel):
    name: str = Field(max_length=16)
    colors: list[Color] = Field(min_length=1, max_length=3)


class Product(BaseModel):
    title: str = Field(max_length=12)
    price_cents: int = Field(ge=1, le=100_000)
    discount: Optional[int] = Field(default=None, ge=0, le=90)
    tags: list[Annotated[str, Field(max_length=6)]] = Field(max_length=2)


@pytest.mark.parametrize("model, prompt", [
    (Person, "Marie is 34 and lives in Lyon, France. Describe her as JSON."),
    (Palette, "A palette called Sea with blue and green. Give it as JSON."),
    (Product, "A red mug at 12.50 dollars, no discount. Give it as JSON."),
])
def test_openai_parse_with_pydantic_models(oai, model, prompt):
    completion = oai.chat.completions.parse(model="tgi", messages=[{"role": "user", "content": prompt}],
                                            response_format=model, max_tokens=90, temperature=0)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, model)
    assert model.model_validate_json(choice.message.content) == choice.message.parsed


def test_openai_json_object_and_completions_json_schema(oai):
    messages = [{"role": "user", "content": 'Reply with exactly this JSON: {"fruit": "apple"}'}]
    chat = oai.chat.completions.create(model="tgi", messages=messages, response_format={"type": "json_object"},
                                       max_tokens=40, temperature=0)
    assert chat.choices[0].finish_reason == "stop", chat.choices[0].message.content
    assert isinstance(json.loads(chat.choices[0].message.content), dict)
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    comp = oai.completions.create(model="tgi", prompt="2 + 2 =", max_tokens=20, temperature=0, extra_body={
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}})
    jsonschema.validate(json.loads(comp.choices[0].text), schema)


# --- TGI clients: parameters.grammar -------------------------------------------------------------------

def test_workshop_example_with_text_generation_client(server):
    client = text_generation.Client(server, timeout=120)
    grammar = text_generation.types.Grammar(type=text_generation.types.GrammarType.Json, value=WORKSHOP_SCHEMA)
    resp = client.generate(WORKSHOP_PROMPT, max_new_tokens=100, grammar=grammar)
    answer = json.loads(resp.generated_text)
    jsonschema.validate(answer, WORKSHOP_SCHEMA)
    assert resp.details.finish_reason.value == "eos_token"
    events = list(client.generate_stream(WORKSHOP_PROMPT, max_new_tokens=100, grammar=grammar))
    assert events[-1].generated_text == resp.generated_text     # greedy: the same JSON streamed


def test_huggingface_hub_grammar(server):
    client = huggingface_hub.InferenceClient(model=server, timeout=120)
    out = client.text_generation(WORKSHOP_PROMPT, max_new_tokens=100,
                                 grammar={"type": "json", "value": WORKSHOP_SCHEMA})
    jsonschema.validate(json.loads(out), WORKSHOP_SCHEMA)


def test_regex_date_is_matched_exactly(server):
    pattern = r"(19|20)\d{2}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
    r = httpx.post(f"{server}/generate", timeout=120, json={
        "inputs": "The first moon landing happened on", "parameters": {
            "max_new_tokens": 20, "details": True, "grammar": {"type": "regex", "value": pattern}}})
    body = r.json()
    assert re.fullmatch(pattern, body["generated_text"]), body
    assert body["details"]["finish_reason"] == "eos_token"


def test_compat_route_stop_sequence_and_best_of(server):
    schema = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[A-Za-z ]{1,10}$"},
                                               "legs": {"type": "integer", "minimum": 0, "maximum": 8}},
              "required": ["name", "legs"], "additionalProperties": False}
    grammar = {"type": "json", "value": schema}
    # "/" with best_of: every copy is constrained
    r = httpx.post(server, timeout=120, json={"inputs": "A spider as JSON:", "parameters": {
        "grammar": grammar, "max_new_tokens": 60, "best_of": 2, "do_sample": True, "details": True}})
    body = r.json()[0]
    details = body["details"]
    for text, reason in [(body["generated_text"], details["finish_reason"])] + [
            (s["generated_text"], s["finish_reason"]) for s in details["best_of_sequences"]]:
        assert reason == "eos_token", body
        jsonschema.validate(json.loads(text), schema)
    # a stop sequence inside the grammar's output ends the request there
    r = httpx.post(f"{server}/generate", timeout=120, json={"inputs": "A spider as JSON:", "parameters": {
        "grammar": grammar, "max_new_tokens": 30, "stop": ['"legs"'], "details": True}})
    body = r.json()
    assert body["details"]["finish_reason"] == "stop_sequence"
    assert body["generated_text"].startswith('{"name": "') and '"legs"' in body["generated_text"]


def test_grammar_that_cannot_finish_ends_with_length(server):
    schema = {"type": "object", "properties": {"essay": {"type": "string", "minLength": 200}}, "required": ["essay"]}
    r = httpx.post(f"{server}/generate", timeout=120, json={"inputs": "Write:", "parameters": {
        "grammar": {"type": "json", "value": schema}, "max_new_tokens": 6, "details": True}})
    assert r.status_code == 200 and r.json()["details"]["finish_reason"] == "length"
    assert r.json()["generated_text"].startswith('{"essay": "')
    assert httpx.get(f"{server}/health", timeout=30).status_code == 200


def test_info_reports_grammar(server):
    info = httpx.get(f"{server}/info").json()
    assert info["grammar_support"] and info["grammar_types"] == ["json", "regex"]


def test_100_sampled_generations_all_validate(server):
    schemas = [
        {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                          "count": {"type": "integer", "minimum": 0, "maximum": 9}},
         "required": ["color", "count"], "additionalProperties": False},
        {"type": "object", "properties": {"ok": {"type": "boolean"}, "tags": {"type": "array", "maxItems": 2,
                                                                             "items": {"enum": ["a", "b"]}}},
         "required": ["ok", "tags"], "additionalProperties": False},
        {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 1, "maxItems": 3},
        {"type": "object", "properties": {"word": {"type": "string", "pattern": "^[a-z]{1,6}$"}},
         "required": ["word"], "additionalProperties": False},
    ]

    async def run() -> list[dict]:
        async with httpx.AsyncClient(base_url=server, timeout=300) as http:
            return [r.json() for r in await asyncio.gather(*(http.post("/generate", json={
                "inputs": f"JSON please ({i}):", "parameters": {
                    "grammar": {"type": "json", "value": schemas[i % 4]}, "do_sample": True, "temperature": 1.0,
                    "max_new_tokens": 40, "details": True}}) for i in range(100)))]
    bodies = asyncio.run(run())
    for i, body in enumerate(bodies):
        assert body["details"]["finish_reason"] == "eos_token", body
        jsonschema.validate(json.loads(body["generated_text"]), schemas[i % 4])


# --- tools ---------------------------------------------------------------------------------------------

def _check_call(call, tool):
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == tool["function"]["name"]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_tool_call_required(oai):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    chat = oai.chat.completions.create(model="tgi", messages=messages, tools=[WEATHER_TOOL, SEARCH_TOOL],
                                       tool_choice="required", max_tokens=60, temperature=0)
    choice = chat.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    _check_call(call, WEATHER_TOOL if call.function.name == "get_weather" else SEARCH_TOOL)


def test_tool_call_named_streamed(oai):
    messages = [{"role": "user", "content": "Find the tallest building in Tokyo."}]
    kwargs = dict(model="tgi", messages=messages, tools=[WEATHER_TOOL, SEARCH_TOOL], max_tokens=60, temperature=0,
                  tool_choice={"type": "function", "function": {"name": "search"}})
    whole = oai.chat.completions.create(**kwargs).choices[0]
    chunks = list(oai.chat.completions.create(**kwargs, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    first = next(d.tool_calls[0] for d in deltas if d.tool_calls)
    assert first.index == 0 and first.id.startswith("call_") and first.function.name == "search"
    arguments = "".join(d.tool_calls[0].function.arguments or "" for d in deltas if d.tool_calls)
    assert len([d for d in deltas if d.tool_calls]) > 2          # the arguments come in pieces
    assert arguments == whole.message.tool_calls[0].function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(arguments), SEARCH_TOOL["function"]["parameters"])
    # the SDK's own accumulator reads the same call back
    with oai.chat.completions.stream(**kwargs) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.tool_calls[0].function.arguments == arguments


def test_tool_choice_auto_and_tool_results_round_trip(oai):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    auto = oai.chat.completions.create(model="tgi", messages=messages, tools=[WEATHER_TOOL], tool_choice="auto",
                                       max_tokens=60, temperature=0).choices[0]
    if auto.message.tool_calls:
        assert auto.finish_reason == "tool_calls"
        _check_call(auto.message.tool_calls[0], WEATHER_TOOL)
    else:
        assert auto.message.content and not auto.message.content.lstrip().startswith("{")
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    history = messages + [{"role": "assistant", "content": None, "tool_calls": [call]},
                          {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"}]
    answer = oai.chat.completions.create(model="tgi", messages=history, tools=[WEATHER_TOOL], tool_choice="none",
                                         max_tokens=12, temperature=0).choices[0]
    assert answer.message.tool_calls is None and answer.message.content
