"""engine.server.reasoning: `<think>…</think>` split into reasoning_content, whole and streamed in every token
split (tags cut anywhere), for qwen3 and deepseek_r1 layouts and templates; and on the chat route (FakeEngine
writing a reasoning model's text), streamed and not, with `--reasoning-parser` auto, named and none."""
from __future__ import annotations

import json

import pytest

from engine.server.reasoning import for_prompt, reasoning_format, reasoning_stream, split_reasoning

QWEN3 = reasoning_format("qwen3", None)
R1 = reasoning_format("deepseek_r1", None)
GPT_OSS = reasoning_format("gpt_oss", None)
HARMONY = ("<|channel|>analysis<|message|>Let me see.<|end|><|start|>assistant<|channel|>final<|message|>"
           "Paris.<|return|>")
GPT_OSS_TEMPLATE = "{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}<|channel|>final"
QWEN3_TEMPLATE = ("{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
                  "{%- endif %}{{- '<|im_start|>assistant\\n' }}")      # the part of Qwen3's template that matters
R1_TEMPLATE = "{% if add_generation_prompt %}{{'<｜Assistant｜><think>\\n'}}{% endif %}"


@pytest.mark.parametrize("fmt, text, reasoning, content", [
    (QWEN3, "<think>\nLet me see.\n</think>\n\nParis.", "\nLet me see.\n", "Paris."),
    (QWEN3, "Paris.", None, "Paris."),                                  # thinking off: no span
    (QWEN3, "<think>\n\n</think>\n\nParis.", "\n\n", "Paris."),
    (QWEN3, "<think>cut off before the end", "cut off before the end", ""),
    (QWEN3, "<thinking is a word>", None, "<thinking is a word>"),
    (QWEN3, "a <think>b</think> c", None, "a <think>b</think> c"),     # only an opening span counts
    (R1, "Hmm, 2+2.</think>\n\n4", "Hmm, 2+2.", "4"),
    (R1, "<think>Hmm</think>4", "Hmm", "4"),
    (R1, "still thinking", "still thinking", ""),
    (GPT_OSS, HARMONY, "Let me see.", "Paris."),
    (GPT_OSS, "Paris.", None, "Paris."),                                # an answer under a grammar: no header
    (GPT_OSS, "<|channel|>final<|message|>Paris.<|return|>", None, "Paris."),
    (GPT_OSS, "<|channel|>analysis<|message|>cut off bef", "cut off bef", ""),
    (GPT_OSS, "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>commentary<|message|>b<|end|>"
              "<|start|>assistant<|channel|>final<|message|>c", "a", "bc"),
    (GPT_OSS, "<|channel|>analysis<|message|>x<|end|><|start|>assistant<|chan", "x", ""),     # a header cut off
    (GPT_OSS, "<|channel|>analys", None, ""),
    (GPT_OSS, "<|channel|>final<|message|>a <|end of nothing|> b", None, "a <|end of nothing|> b"),
])
def test_split_whole_and_streamed_in_every_cut(fmt, text, reasoning, content):
    assert split_reasoning(text, fmt) == (reasoning, content)
    for cut in range(len(text) + 1):
        for step in (1, 3):
            stream = reasoning_stream(fmt)
            pieces = stream.feed(text[:cut])
            pieces += [p for i in range(cut, len(text), step) for p in stream.feed(text[i:i + step])]
            pieces += stream.finish()
            assert "".join(t for k, t in pieces if k == "reasoning") == (reasoning or ""), (cut, step, pieces)
            assert "".join(t for k, t in pieces if k == "content") == content, (cut, step, pieces)


def test_auto_reads_the_template():
    assert reasoning_format("auto", QWEN3_TEMPLATE).name == "qwen3"
    assert reasoning_format("auto", R1_TEMPLATE).name == "deepseek_r1"
    assert reasoning_format("auto", "{{ messages }}") is None and reasoning_format("auto", None) is None
    assert reasoning_format("none", QWEN3_TEMPLATE) is None
    assert reasoning_format("auto", GPT_OSS_TEMPLATE) == GPT_OSS


@pytest.mark.parametrize("parser, split", [("auto", True), ("qwen3", True), ("none", False)])
def test_chat_route_streamed_and_not(monkeypatch, parser, split):
    pytest.importorskip("torch")
    import test_server
    from starlette.testclient import TestClient
    monkeypatch.setattr(test_server, "SCRIPT", "<think>\nwhy</think>\n\nbecause")
    monkeypatch.setattr(test_server.CharTokenizer, "chat_template", QWEN3_TEMPLATE)
    app, engine, _ = test_server.make_app(reasoning_parser=parser)
    body = {"messages": [{"role": "user", "content": "why?"}], "max_tokens": 28}
    try:
        with TestClient(app) as client:
            message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
            with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
                deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in r.iter_lines()
                          if line.startswith("data: {")]
    finally:
        engine.close()
    streamed = ("".join(d.get("reasoning_content") or "" for d in deltas),
                "".join(d.get("content") or "" for d in deltas))
    if split:
        assert (message["reasoning_content"], message["content"]) == ("\nwhy", "because") == streamed
    else:
        assert "reasoning_content" not in message and message["content"] == "<think>\nwhy</think>\n\nbecause"
        assert streamed == ("", message["content"])


def test_messages_thinking_block_streamed_and_not(monkeypatch):
    pytest.importorskip("torch")
    anthropic = pytest.importorskip("anthropic")
    import test_server
    from starlette.testclient import TestClient
    monkeypatch.setattr(test_server, "SCRIPT", "<think>\nwhy</think>\n\nbecause")
    monkeypatch.setattr(test_server.CharTokenizer, "chat_template", QWEN3_TEMPLATE)
    app, engine, _ = test_server.make_app()
    body = {"model": "m", "messages": [{"role": "user", "content": "why?"}], "max_tokens": 28,
            "thinking": {"type": "enabled", "budget_tokens": 1024}}
    try:
        with TestClient(app) as http:
            client = anthropic.Anthropic(base_url=str(http.base_url), api_key="x", http_client=http, max_retries=0)
            message = client.messages.create(**body)
            with client.messages.stream(**body) as stream:
                final = stream.get_final_message()
    finally:
        engine.close()
    for answer in (message, final):
        assert [b.type for b in answer.content] == ["thinking", "text"]
        assert answer.content[0].thinking == "\nwhy" and answer.content[1].text == "because"


def test_responses_reasoning_item_streamed_and_not(monkeypatch):
    pytest.importorskip("torch")
    import test_server
    from starlette.testclient import TestClient
    monkeypatch.setattr(test_server, "SCRIPT", "<think>\nwhy</think>\n\nbecause")
    monkeypatch.setattr(test_server.CharTokenizer, "chat_template", QWEN3_TEMPLATE)
    app, engine, _ = test_server.make_app()
    body = {"input": "why?", "max_output_tokens": 28}
    try:
        with TestClient(app) as http:
            response = http.post("/v1/responses", json=body).json()
            with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
                events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    finally:
        engine.close()
    final = events[-1]["response"]
    for answer in (response, final):
        reasoning, message = answer["output"]
        assert reasoning["type"] == "reasoning" and reasoning["content"][0]["text"] == "\nwhy"
        assert message["type"] == "message" and message["content"][0]["text"] == "because"
    for answer in (response, final):    # one token per character: `<think>\nwhy</think>` is 19
        assert answer["usage"]["output_tokens_details"]["reasoning_tokens"] == 19
        assert answer["usage"]["output_tokens"] == 28
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == "\nwhy"
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "because"
    added = [(e["output_index"], e["item"]["type"]) for e in events if e["type"] == "response.output_item.added"]
    assert added == [(0, "reasoning"), (1, "message")]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_each_answer_follows_where_its_prompt_ends():
    assert for_prompt(QWEN3, "<|im_start|>assistant\n") is QWEN3
    assert for_prompt(QWEN3, "<|im_start|>assistant\n<think>\n\n</think>\n\n") is None      # thinking off
    assert for_prompt(R1, "<｜Assistant｜></think>") is None                                    # DeepSeek-V3.1 off
    opened = for_prompt(QWEN3, "<｜Assistant｜><think>")                                         # and on
    assert opened.opened_in_prompt and split_reasoning("why</think>so", opened) == ("why", "so")
    assert for_prompt(R1, "<｜Assistant｜><think>\n") is R1 and for_prompt(None, "<think>") is None


def test_harmony_channels_on_the_chat_and_responses_routes(monkeypatch):
    """gpt-oss: the analysis channel is the reasoning, streamed and not; special tokens stay in the decoded text."""
    pytest.importorskip("torch")
    import test_server
    from starlette.testclient import TestClient
    monkeypatch.setattr(test_server, "SCRIPT", HARMONY)
    monkeypatch.setattr(test_server.CharTokenizer, "chat_template", GPT_OSS_TEMPLATE)
    app, engine, _ = test_server.make_app()
    body = {"messages": [{"role": "user", "content": "why?"}], "max_tokens": len(HARMONY)}
    try:
        with TestClient(app) as client:
            assert app.state.server.validator.skip_special_tokens is False
            message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
            with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
                deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in r.iter_lines()
                          if line.startswith("data: {")]
            output = client.post("/v1/responses", json={"input": "why?", "max_output_tokens": len(HARMONY)}).json()
            budgeted = client.post("/v1/chat/completions", json={**body, "max_reasoning_tokens": 4})
    finally:
        engine.close()
    assert (message["reasoning_content"], message["content"]) == ("Let me see.", "Paris.")
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "Let me see."
    assert "".join(d.get("content") or "" for d in deltas) == "Paris."
    reasoning, answer = output["output"]
    assert reasoning["content"][0]["text"] == "Let me see." and answer["content"][0]["text"] == "Paris."
    spent = output["usage"]["output_tokens_details"]["reasoning_tokens"]
    assert spent == len("<|channel|>analysis<|message|>Let me see.<|end|>")    # one token per character
    assert budgeted.status_code == 200, budgeted.text    # a budget for harmony: engine/server/harmony.final_grammar
