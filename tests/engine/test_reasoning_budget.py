"""A reasoning model's span and the request's grammar, through the launcher (tiny-llama as a deepseek_r1-style
reasoner: its output starts inside the span) and the real `openai` client: `max_reasoning_tokens` closes the span
at that many tokens; response_format and tool grammars apply only after it (the JSON after the reasoning
validates, the calls come after the reasoning, streamed and not); `chat_template_kwargs` reach the template
(Qwen3's enable_thinking switch), and the ones the server sets are refused."""
from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("torch")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from test_clients import assert_all_blocks_free, start_server, stop_server  # noqa: E402

from engine.server.errors import ValidationError  # noqa: E402
from engine.server.openai_routes import _grammar  # noqa: E402
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


@pytest.fixture(scope="module")
def client(model_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reasoner")
    folder = tmp / "tiny"
    shutil.copytree(model_path("tiny-llama"), folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    proc, url, log = start_server(folder, tmp, "--reasoning-parser", "deepseek_r1")
    try:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=120, max_retries=0)
        assert_all_blocks_free(url)
    finally:
        stop_server(proc)
    assert "Traceback" not in log.read_text()


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
        _grammar(req, None, None, None)
