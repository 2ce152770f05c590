"""gpt-oss harmony tool calls (engine.server.harmony): messages to `functions.NAME` read as OpenAI tool calls, whole
and streamed in every cut (markers split anywhere), with hostile texts (partial frames, unknown recipients, bad
JSON, a cut-off call); the grammar that forces a call, checked by llguidance token by token on a tokenizer that
has harmony's special tokens; and the chat route through the real `openai` client, streamed and not."""
from __future__ import annotations

import json

import pytest

from engine.server.harmony import HarmonyStream, call_grammar, read_harmony
from engine.structured.tool_calls import Tool, detect_format

TOOLS = {"get_weather", "add"}
CALL = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
THOUGHT = "<|channel|>analysis<|message|>I need the weather.<|end|><|start|>assistant"
ADD = '<|start|>assistant<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 1, "b": 2}<|call|>'
GPT_OSS_TEMPLATE = ("{%- if tools %}namespace functions{%- endif %}"
                    "{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}<|channel|>final")
PARIS = ("get_weather", '{"city": "Paris"}')


@pytest.mark.parametrize("text, reasoning, content, calls", [
    (THOUGHT + CALL, "I need the weather.", "", [PARIS]),
    (CALL[:-len("<|call|>")], None, "", [PARIS]),                   # <|call|> is an end token: often not in the text
    # the recipient in the role part of the header, before the channel
    ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>',
     None, "", [PARIS]),
    (CALL + ADD, None, "", [PARIS, ("add", '{"a": 1, "b": 2}')]),  # two calls in one turn
    (CALL.replace("functions.get_weather", "functions.nope"), None, '{"city": "Paris"}', []),     # unknown function
    (CALL.replace("functions.get_weather", "browser.search"), None, '{"city": "Paris"}', []),     # built-in tool
    (CALL.replace("functions.get_weather", "functions.get_weather_x"), None, '{"city": "Paris"}', []),
    (CALL.replace('{"city": "Paris"}', '{"city": "Par'), None, '{"city": "Par', []),             # cut off
    (CALL.replace('{"city": "Paris"}', '[1, 2]'), None, "[1, 2]", []),                           # not an object
    (CALL.replace('{"city": "Paris"}', "city=Paris"), None, "city=Paris", []),                   # not JSON
    (THOUGHT + "<|channel|>commentary to=functions.get_wea", "I need the weather.", "", []),   # a header cut off
    (THOUGHT + "<|channel|>final<|message|>It is sunny.<|return|>", "I need the weather.", "It is sunny.", []),
    ("<|channel|>commentary<|message|>Let me check.<|end|><|start|>assistant" + CALL, None, "", [PARIS]),
    ("It is sunny.", None, "It is sunny.", []),
    ("", None, "", []),
])
def test_calls_whole_and_streamed_in_every_cut(text, reasoning, content, calls):
    got_reasoning, got_content, got_calls = read_harmony(text, TOOLS)
    assert (got_reasoning, [(c.name, c.arguments) for c in got_calls]) == (reasoning, calls)
    if not calls:
        assert got_content == content
    for cut in range(len(text) + 1):
        for step in (1, 5):
            stream = HarmonyStream(TOOLS)
            pieces = stream.feed(text[:cut])
            pieces += [p for i in range(cut, len(text), step) for p in stream.feed(text[i:i + step])]
            pieces += stream.finish()
            names = [t for kind, t in pieces if kind == "name"]
            assert [(c.name, c.arguments) for c in stream.tool_calls()] == calls, (cut, step, pieces)
            assert names[:len(calls)] == [name for name, _ in calls]
            assert "".join(t for kind, t in pieces if kind == "reasoning") == (reasoning or "")
            arguments = "".join(t for kind, t in pieces if kind == "arguments")
            assert arguments == "".join(args for _, args in stream.calls)
            assert not any("<|" in t for _, t in pieces if _ != "name"), pieces


def test_without_tools_calls_are_not_read():
    """A request with no tools: the message's body is content, as before."""
    stream = HarmonyStream()
    pieces = stream.feed(CALL) + stream.finish()
    assert pieces == [("content", '{"city": "Paris"}')] and stream.tool_calls() == []


def test_auto_picks_harmony_from_the_template():
    assert detect_format(GPT_OSS_TEMPLATE).name == "harmony"
    assert detect_format(GPT_OSS_TEMPLATE, "hermes").name == "hermes"


@pytest.fixture(scope="module")
def harmony_tokenizer(model_path):
    """SmolLM2's tokenizer plus harmony's markers as special tokens (gpt-oss's own is not on this machine)."""
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path("smollm2"))
    tokenizer.add_special_tokens({"additional_special_tokens": [
        "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>", "<|return|>"]})
    return tokenizer


def test_the_grammar_forces_one_call_to_a_known_tool(harmony_tokenizer):
    llguidance = pytest.importorskip("llguidance")
    import llguidance.hf

    tokenizer = harmony_tokenizer
    tools = [Tool("get_weather", "", {"type": "object", "properties": {"city": {"type": "string"}},
                                      "required": ["city"]}),
             Tool("add", "", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}})]
    spec = call_grammar(tools, tokenizer)
    assert "<[" in spec.grammar            # the markers are forced as special tokens
    table = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))
    grammar = llguidance.LLMatcher.grammar_from_lark(spec.grammar)

    def accepted(text: str) -> bool:
        matcher = llguidance.LLMatcher(table, grammar)
        ids = tokenizer.encode(text, add_special_tokens=False)
        return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()

    assert accepted(THOUGHT + CALL)
    assert accepted(CALL) and accepted(ADD[len("<|start|>assistant"):])
    assert not accepted(CALL.replace("get_weather", "nope"))                        # unknown function
    assert not accepted(CALL.replace('"Paris"', "3"))                               # arguments off the schema
    assert not accepted(CALL.replace('{"city": "Paris"}', '{"city": "Paris", "x": 1}'))   # undeclared argument
    assert not accepted("<|channel|>final<|message|>It is sunny.<|return|>")        # no call
    assert not accepted(CALL + ADD)                                                  # one call per turn


def test_chat_route_returns_and_streams_the_call_through_the_openai_client(monkeypatch):
    pytest.importorskip("torch")
    openai = pytest.importorskip("openai")
    import test_server
    from starlette.testclient import TestClient
    script = THOUGHT + CALL
    monkeypatch.setattr(test_server, "SCRIPT", script)
    monkeypatch.setattr(test_server.CharTokenizer, "chat_template", GPT_OSS_TEMPLATE)
    rendered = []
    plain = test_server.CharTokenizer.apply_chat_template

    def with_tools(self, messages, tools=None, **kwargs):   # gpt-oss's template renders the tools itself
        rendered.append(tools)
        return plain(self, messages, **kwargs)
    monkeypatch.setattr(test_server.CharTokenizer, "apply_chat_template", with_tools)
    app, engine, _ = test_server.make_app()
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "weather?"}], "tools": tools,
            "max_tokens": len(script) + 8, "stop": ["<|call|>"]}    # gpt-oss's <|call|> is an end token
    try:
        with TestClient(app) as http:
            client = openai.OpenAI(base_url=str(http.base_url).rstrip("/") + "/v1", api_key="x", http_client=http, max_retries=0)
            whole = client.chat.completions.create(**body)
            chunks = list(client.chat.completions.create(**body, stream=True))
            other = client.chat.completions.create(**{**body, "tools": [{"type": "function", "function": {
                "name": "get_time"}}]})
    finally:
        engine.close()
    assert rendered[0][0]["function"]["name"] == "get_weather"      # the template got the tools
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.reasoning_content == "I need the weather."
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert streamed[0].function.name == "get_weather" and streamed[0].id and streamed[0].index == 0
    assert "".join(tc.function.arguments or "" for tc in streamed) == '{"city": "Paris"}'
    assert {tc.index for tc in streamed} == {0}
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "I need the weather."
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    # a call to a function the request does not offer is not a tool call
    assert other.choices[0].message.tool_calls is None and other.choices[0].finish_reason != "tool_calls"
    assert other.choices[0].message.content == '{"city": "Paris"}'


def test_analysis_spans_cover_each_analysis_message():
    from engine.server.harmony import analysis_spans
    text = THOUGHT + "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>analysis<|message|>x"
    first = "<|channel|>analysis<|message|>I need the weather.<|end|>"
    second_at = text.rindex("<|start|>assistant<|channel|>analysis")
    assert analysis_spans(text) == [(0, len(first)), (second_at, len(text))]
    assert analysis_spans("Paris.") == [] and analysis_spans(CALL) == []


def test_responses_and_messages_read_the_call_streamed_and_not(monkeypatch):
    pytest.importorskip("torch")
    import test_server
    from starlette.testclient import TestClient
    script = THOUGHT + CALL
    monkeypatch.setattr(test_server, "SCRIPT", script)
    monkeypatch.setattr(test_server.CharTokenizer, "chat_template", GPT_OSS_TEMPLATE)
    plain = test_server.CharTokenizer.apply_chat_template
    monkeypatch.setattr(test_server.CharTokenizer, "apply_chat_template",
                        lambda self, messages, tools=None, **kwargs: plain(self, messages, **kwargs))
    app, engine, _ = test_server.make_app()
    parameters = {"type": "object", "properties": {"city": {"type": "string"}}}
    responses = {"input": "weather?", "max_output_tokens": len(script) + 8, "stop": ["<|call|>"],
                 "tools": [{"type": "function", "name": "get_weather", "parameters": parameters}]}
    messages = {"model": "m", "max_tokens": len(script) + 8, "stop_sequences": ["<|call|>"],
                "messages": [{"role": "user", "content": "weather?"}],
                "tools": [{"name": "get_weather", "input_schema": parameters}]}
    try:
        with TestClient(app) as http:
            whole = http.post("/v1/responses", json=responses).json()
            with http.stream("POST", "/v1/responses", json={**responses, "stream": True}) as r:
                events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
            message = http.post("/v1/messages", json=messages).json()
    finally:
        engine.close()
    for output in (whole["output"], events[-1]["response"]["output"]):
        reasoning, call = output
        assert reasoning["type"] == "reasoning" and reasoning["content"][0]["text"] == "I need the weather."
        assert (call["type"], call["name"], json.loads(call["arguments"])) == \
            ("function_call", "get_weather", {"city": "Paris"})
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert deltas == '{"city": "Paris"}'
    assert whole["usage"]["output_tokens_details"]["reasoning_tokens"] == len(THOUGHT) - len("<|start|>assistant")
    blocks = [b for b in message["content"] if b["type"] == "tool_use"]
    assert [(b["name"], b["input"]) for b in blocks] == [("get_weather", {"city": "Paris"})]
    assert message["stop_reason"] == "tool_use"
