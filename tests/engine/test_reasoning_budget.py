"""A reasoning model's span and the request's grammar, through the launcher (tiny-llama as a deepseek_r1-style
reasoner: its output starts inside the span) and the real `openai` client: `max_reasoning_tokens` closes the span
at that many tokens; response_format and tool grammars apply only after it (the JSON after the reasoning
validates, the calls come after the reasoning, streamed and not); `chat_template_kwargs` reach the template
(Qwen3's enable_thinking switch), and the ones the server sets are refused. The same budget and grammars through
Anthropic Messages (`thinking.budget_tokens`: a `thinking` block, then the text or tool_use blocks) and Responses
(`reasoning.max_tokens`: a `reasoning` item, then the message or function calls), with the real `anthropic` and
`openai` clients, streamed and not."""
from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("torch")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from test_clients import assert_all_blocks_free, start_server, stop_server  # noqa: E402

from engine.server.errors import ValidationError  # noqa: E402
from engine.server.reasoning_request import request_grammar  # noqa: E402
from engine.server.protocol import ChatCompletionRequest  # noqa: E402

pytestmark = pytest.mark.slow
# ChatML with the part of Qwen3's template that `enable_thinking: false` changes
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
            "enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "maximum": 9}, "b": {"type": "integer", "maximum": 9}},
    "required": ["a", "b"]}}}
ASK = [{"role": "user", "content": "Think, then answer."}]
DIGITS = {"type": "object", "properties": {"a": {"enum": [1, 2, 3]}, "b": {"enum": [4, 5, 6]}}, "required": ["a", "b"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reasoner")
    folder = tmp / "tiny"
    shutil.copytree(model_path("tiny-llama"), folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    proc, url, log = start_server(folder, tmp, "--reasoning-parser", "deepseek_r1")
    try:
        yield url
        assert_all_blocks_free(url)
    finally:
        stop_server(proc)
    assert "Traceback" not in log.read_text()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", timeout=120, max_retries=0)


def tokens(client, text: str) -> int:
    return client.completions.create(model="tgi", prompt=text, max_tokens=1).usage.prompt_tokens


@pytest.mark.parametrize("budget", [3, 12])
def test_budget_closes_the_span_and_the_json_after_it_validates(client, budget):
    for seed in range(2):
        choice = client.chat.completions.create(
            model="tgi", messages=ASK, seed=seed, max_tokens=120, extra_body={"max_reasoning_tokens": budget},
            logprobs=True,
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}).choices[0]
        assert choice.finish_reason == "stop", repr(choice.message.content)
        reasoning = choice.message.model_extra["reasoning_content"]
        generated = [t.token for t in choice.logprobs.content]
        closing = next(i for i, t in enumerate(generated) if "<" in t)     # where "</think>" begins
        assert reasoning and 0 < closing <= budget, (closing, generated)
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_tool_calls_come_after_the_reasoning_streamed_and_not(client):
    kwargs = dict(model="tgi", messages=ASK, tools=[ADD], tool_choice="required", seed=1, max_tokens=120,
                  parallel_tool_calls=False, extra_body={"max_reasoning_tokens": 6})
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.model_extra["reasoning_content"]
    [call] = whole.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), ADD["function"]["parameters"])
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    arguments = "".join(t.function.arguments or "" for d in deltas for t in d.tool_calls or [])
    first_call = next(i for i, d in enumerate(deltas) if d.tool_calls)
    assert all(not (d.model_extra or {}).get("reasoning_content") for d in deltas[first_call:])
    assert reasoning == whole.message.model_extra["reasoning_content"] and arguments == call.function.arguments


def test_chat_template_kwargs_reach_the_template(client):
    on = client.chat.completions.create(model="tgi", messages=ASK, max_tokens=1)
    off = client.chat.completions.create(model="tgi", messages=ASK, max_tokens=1,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.usage.prompt_tokens == on.usage.prompt_tokens + tokens(client, "<think>\n\n</think>\n\n") - 1
    with pytest.raises(openai.UnprocessableEntityError) as info:
        client.chat.completions.create(model="tgi", messages=ASK, max_tokens=1,
                                       extra_body={"chat_template_kwargs": {"add_generation_prompt": False}})
    assert "cannot set add_generation_prompt" in info.value.response.text
    with pytest.raises(openai.UnprocessableEntityError):
        client.chat.completions.create(model="tgi", messages=ASK, max_tokens=1,
                                       extra_body={"max_reasoning_tokens": 0})


def test_a_budget_needs_a_reasoning_model():
    req = ChatCompletionRequest.model_validate({"messages": ASK, "max_reasoning_tokens": 4})
    with pytest.raises(ValidationError, match="needs a reasoning model"):
        request_grammar(req, None, None, None)


def test_messages_thinking_budget_then_tool_use_streamed_and_not(server, client):
    anthropic = pytest.importorskip("anthropic")
    claude = anthropic.Anthropic(base_url=server, api_key="none", timeout=120, max_retries=0)
    tool = {"name": "add", "input_schema": DIGITS}
    for budget, tools in [(4, [tool]), (6, [])]:
        kwargs = dict(model="tiny", max_tokens=120 if tools else 16, messages=ASK, extra_body={"temperature": 0},
                      thinking={"type": "enabled", "budget_tokens": budget},
                      **({"tools": tools, "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}
                         if tools else {}))
        whole = claude.messages.create(**kwargs)
        kinds = [b.type for b in whole.content]
        assert kinds[0] == "thinking" and set(kinds[1:]) == ({"tool_use"} if tools else {"text"}), whole.content
        assert 0 < tokens(client, whole.content[0].thinking) <= budget + 1      # (+1: the prompt's BOS)
        if tools:
            for block in whole.content[1:]:
                jsonschema.validate(block.input, tool["input_schema"])
            assert whole.stop_reason == "tool_use"
        with claude.messages.stream(**kwargs) as stream:
            events = list(stream)
            final = stream.get_final_message()
        thinking = "".join(e.delta.thinking for e in events
                           if e.type == "content_block_delta" and e.delta.type == "thinking_delta")
        assert thinking == whole.content[0].thinking
        assert [b.model_dump(exclude={"id"}) for b in final.content] == [b.model_dump(exclude={"id"})
                                                                        for b in whole.content]


def test_responses_reasoning_budget_then_json_or_calls_streamed_and_not(client):
    text = {"format": {"type": "json_schema", "name": "p", "schema": SCHEMA}}
    tool = {"type": "function", "name": "add", "parameters": DIGITS}
    for budget, extra in [(5, {"text": text}),
                          (3, {"tools": [tool], "tool_choice": "required", "parallel_tool_calls": False})]:
        kwargs = dict(model="tiny", input="Think, then answer.", max_output_tokens=80, temperature=0,
                      reasoning={"max_tokens": budget}, **extra)
        whole = client.responses.create(**kwargs)
        kinds = [item.type for item in whole.output]
        assert kinds[0] == "reasoning" and set(kinds[1:]) == ({"message"} if "text" in extra else {"function_call"})
        reasoning = whole.output[0].content[0].text
        assert 0 < tokens(client, reasoning) <= budget + 1
        if "text" in extra:
            jsonschema.validate(json.loads(whole.output_text), SCHEMA)
        else:
            for item in whole.output[1:]:
                jsonschema.validate(json.loads(item.arguments), tool["parameters"])
        events = list(client.responses.create(**kwargs, stream=True))
        streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        final = events[-1].response
        assert streamed == reasoning and [i.type for i in final.output] == kinds
        assert final.output[1:] and (final.output_text == whole.output_text)


@pytest.mark.parametrize("route, body, message", [
    ("/v1/messages", {"max_tokens": 4, "thinking": {"type": "enabled", "budget_tokens": 0}}, "budget_tokens"),
    ("/v1/messages", {"max_tokens": 4, "thinking": {"type": "sometimes"}}, "`thinking.type`"),
    ("/v1/responses", {"reasoning": {"effort": "extreme"}}, "`reasoning.effort`"),
    ("/v1/responses", {"reasoning": {"max_tokens": "many"}}, "`reasoning.max_tokens`"),
])
def test_reasoning_fields_refused_by_name(server, route, body, message):
    import httpx
    key = "messages" if route == "/v1/messages" else "input"
    reply = httpx.post(f"{server}{route}", json={"model": "tiny", key: ASK, **body}, timeout=60)
    assert reply.status_code == 422 and message in reply.text, reply.text


def test_thinking_off_on_messages_and_responses_reaches_the_template_and_reads_no_span(server, client):
    anthropic = pytest.importorskip("anthropic")
    claude = anthropic.Anthropic(base_url=server, api_key="none", timeout=120, max_retries=0)
    kwargs = dict(model="tiny", max_tokens=6, messages=ASK)
    on = claude.messages.create(**kwargs)
    off = claude.messages.create(**kwargs, thinking={"type": "disabled"})
    assert [b.type for b in on.content][0] == "thinking" and [b.type for b in off.content] == ["text"]
    assert off.usage.input_tokens > on.usage.input_tokens       # the template's `<think>\n\n</think>\n\n`
    output = client.responses.create(model="tiny", input=ASK[0]["content"], max_output_tokens=6,
                                     reasoning={"effort": "none"}).output
    assert [item.type for item in output] == ["message"]
