"""Tool calls per family against the real launcher and the real `openai` client: tiny random models whose
tokenizer_config carries the family's real chat template (tests/data/chat_templates: Qwen2.5's Hermes
<tool_call>, Llama 3.1's JSON, Mistral v0.3's [TOOL_CALLS], DeepSeek-V3.1's <｜tool▁call▁begin｜>). The parser is the one the template implies; every
call validates against its tool; one and several calls per turn, streamed (OpenAI's tool_calls `index`) and not,
agree to the byte for the same seed; parallel_tool_calls false gives one; named, none and auto hold; the calls
and their results go back through the template; bad requests are 422s."""
from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("torch")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from test_clients import assert_all_blocks_free, start_server, stop_server  # noqa: E402

pytestmark = pytest.mark.slow

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "chat_templates"
FAMILIES = {"hermes": ("tiny-qwen3", "qwen2_5.jinja"), "llama3": ("tiny-llama", "llama3_1.jinja"),
            "mistral": ("tiny-mistral", "mistral_v0_3.jinja"), "deepseek_v3": ("tiny-qwen3", "deepseek_v3_1.jinja")}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                                   "b": {"type": "integer", "minimum": -99, "maximum": 99}},
                   "required": ["a", "b"]}}}
TOOLS = {t["function"]["name"]: t for t in (WEATHER, ADD)}
ASK = [{"role": "user", "content": "Weather in Paris and Rome, and 2 + 3?"}]
SEEDS = 6


def family_model(model_path, tmp: Path, family: str) -> Path:
    name, template = FAMILIES[family]
    folder = tmp / name
    shutil.copytree(model_path(name), folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = (TEMPLATES / template).read_text()
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    model = json.loads((folder / "config.json").read_text())
    model["max_position_embeddings"] = 2048     # room for the templates' tool prompts (random weights anyway)
    (folder / "config.json").write_text(json.dumps(model))
    return folder


@pytest.fixture(scope="module", params=[f for f in FAMILIES if f != "deepseek_v3"])
def family(request, model_path, tmp_path_factory):
    """A server per family. DeepSeek-V3.1 only runs the format's own round trip (one and two calls, streamed and
    not): the rest is the same machinery, checked on the others."""
    tmp = tmp_path_factory.mktemp(request.param)
    proc, url, log = start_server(family_model(model_path, tmp, request.param), tmp,
                                  "--max-concurrent-requests", "32")
    try:
        yield request.param, openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=120, max_retries=0), url
        assert_all_blocks_free(url)
    finally:
        stop_server(proc)
    assert "Traceback" not in log.read_text()


def check(calls) -> None:
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), TOOLS[call.function.name]["function"]["parameters"])


def ask(client, seed: int, stream: bool, **kwargs):
    """(finish_reason, [(id, name, arguments)]) of one answer; a stream's pieces put together by their index."""
    kwargs = dict(model="tgi", messages=ASK, tools=[WEATHER, ADD], tool_choice="required", seed=seed,
                  max_tokens=240) | kwargs
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        check(choice.message.tool_calls or [])
        return choice.finish_reason, [(c.id, c.function.name, c.function.arguments)
                                      for c in choice.message.tool_calls or []]
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            assert not choice.delta.content
            for piece in choice.delta.tool_calls or []:
                if piece.id is not None:
                    assert piece.index == len(calls) and piece.function.name
                    calls[piece.index] = [piece.id, piece.function.name, ""]
                calls[piece.index][2] += piece.function.arguments or ""
    return finish, [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("family", list(FAMILIES), indirect=True)
def test_one_and_several_calls_streamed_and_not_agree(family):
    name, client, _ = family
    with ThreadPoolExecutor(8) as pool:
        whole = list(pool.map(lambda s: ask(client, s, False), range(SEEDS)))
        streamed = list(pool.map(lambda s: ask(client, s, True), range(SEEDS)))
    counts = set()
    for seed, ((finish, calls), (s_finish, s_calls)) in enumerate(zip(whole, streamed)):
        assert calls, (seed, finish)                 # "required" always answers with a call
        assert finish == s_finish and [c[1:] for c in calls] == [c[1:] for c in s_calls], seed
        if finish == "tool_calls":
            counts.add(min(len(calls), 2))
        for call_id, _, arguments in s_calls:
            json.loads(arguments)
            if name == "mistral":
                assert len(call_id) == 9 and call_id.isalnum()
    assert counts == {1, 2}, (name, whole)         # one call, and parallel calls, among the seeds


def test_parallel_tool_calls_false_and_named(family):
    _, client, _ = family

    def run(seed):
        single = ask(client, seed, seed % 2 == 1, parallel_tool_calls=False)
        named = ask(client, seed, False, tool_choice={"type": "function", "function": {"name": "add"}}, max_tokens=120)
        return single, named
    with ThreadPoolExecutor(4) as pool:
        for seed, ((finish, calls), (_, named)) in enumerate(pool.map(run, range(4))):
            assert finish == "tool_calls" and len(calls) == 1, (seed, calls)
            assert named and {c[1] for c in named} == {"add"}


def test_none_and_auto(family):
    _, client, _ = family
    none = client.chat.completions.create(model="tgi", messages=ASK, tools=[WEATHER, ADD], tool_choice="none",
                                          max_tokens=12, seed=0).choices[0]
    assert none.message.tool_calls is None and none.message.content is not None
    with ThreadPoolExecutor(4) as pool:
        choices = list(pool.map(lambda seed: client.chat.completions.create(
            model="tgi", messages=ASK, tools=[WEATHER, ADD], seed=seed, max_tokens=40).choices[0], range(4)))
    for choice in choices:
        if choice.message.tool_calls:
            check(choice.message.tool_calls)
            assert choice.message.content is None
        else:
            assert choice.message.content is not None and choice.finish_reason in ("stop", "length")


def test_calls_and_results_go_back_through_the_template(family):
    name, client, _ = family
    first = next(c for seed in range(SEEDS) if len((c := client.chat.completions.create(
        model="tgi", messages=ASK, tools=[WEATHER, ADD], tool_choice="required", seed=seed,
        max_tokens=240).choices[0]).message.tool_calls or []) >= 2 and c.finish_reason == "tool_calls")
    calls = first.message.tool_calls
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]}] + [
        {"role": "tool", "tool_call_id": c.id, "content": f"result {i}"} for i, c in enumerate(calls)]
    answer = client.chat.completions.create(model="tgi", messages=history, tools=[WEATHER, ADD], max_tokens=8,
                                            seed=0, tool_choice="none")
    before = client.chat.completions.create(model="tgi", messages=ASK, tools=[WEATHER, ADD], max_tokens=1,
                                            tool_choice="none")
    grown = answer.usage.prompt_tokens - before.usage.prompt_tokens
    assert grown > sum(len(c.function.arguments) for c in calls) // 4, grown   # the calls and results are there
    # OpenAI-style ids sent back to a Mistral template are mapped onto its 9-character ones
    renamed = [{**m, "tool_calls": [{**c, "id": f"call_{i}xyz"} for i, c in enumerate(m["tool_calls"])]}
               if m.get("tool_calls") else m for m in history]
    renamed = [{**m, "tool_call_id": f"call_{history.index(m) - len(ASK) - 1}xyz"} if m["role"] == "tool" else m
               for m in renamed]
    again = client.chat.completions.create(model="tgi", messages=renamed, tools=[WEATHER, ADD], max_tokens=8,
                                           seed=0, tool_choice="none")
    assert again.usage.prompt_tokens > before.usage.prompt_tokens


@pytest.mark.parametrize("body, message", [
    ({"tool_choice": {"type": "function", "function": {"name": "rm_rf"}}}, "'rm_rf' is not in `tools`"),
    ({"tool_choice": "sometimes"}, "`tool_choice` must be"),
    ({"messages": ASK + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{not json"}}]}]},
     "`messages[1].tool_calls[0].function.arguments` must be a JSON object"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "must be 1-64 letters"),
])
def test_bad_tool_requests_are_422(family, body, message):
    import httpx
    _, _, url = family
    reply = httpx.post(f"{url}/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER, ADD]} | body)
    assert reply.status_code == 422 and message in reply.json()["error"], reply.text
    assert reply.json()["error_type"] == "validation"


def test_parallel_calls_through_the_responses_api(family):
    _, client, _ = family
    tools = [{"type": "function", **t["function"]} for t in (WEATHER, ADD)]
    seed, calls = next((s, c) for s in range(SEEDS) if len((c := ask(client, s, False)[1])) >= 2)
    kwargs = dict(model="tgi", input=ASK[0]["content"], tools=tools, tool_choice="required",
                  extra_body={"seed": seed}, max_output_tokens=240)
    whole = client.responses.create(**kwargs)
    assert [(o.name, o.arguments) for o in whole.output] == [c[1:] for c in calls]
    events = list(client.responses.create(**kwargs, stream=True))
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [e.output_index for e in added] == list(range(len(calls)))
    streamed = events[-1].response.output
    assert [(o.name, o.arguments) for o in streamed] == [c[1:] for c in calls]
    assert len({o.call_id for o in streamed}) == len(calls)
    for i, item in enumerate(streamed):
        deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta"
                         and e.item_id == item.id)
        assert deltas == item.arguments and added[i].item.id == item.id
