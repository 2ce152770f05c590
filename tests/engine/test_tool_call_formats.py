"""engine.structured.tool_calls per family (hermes, mistral, llama3, deepseek_v3, deepseek_r1, json): one and two
calls written, read back whole and streamed in every cut (each call's index, its arguments to the byte), the
markers as text or dropped as special tokens; hostile model outputs (cut-off JSON, unknown names, prose around the
calls) read as plain text; the parallel grammar (several calls, one with parallel_tool_calls false); the template
inputs (Llama's one call per turn, Mistral's 9-character ids); and R1's calls as its real template writes them."""
from __future__ import annotations


import pytest

pytest.importorskip("llguidance")

from fakes import test_model_path  # noqa: E402

from engine.server.protocol import ChatCompletionRequest  # noqa: E402
from engine.server.tools import template_inputs, tool_use  # noqa: E402
from engine.structured.compiler import GrammarCompiler  # noqa: E402
from engine.structured.tool_calls import (FORMATS, MAX_CALLS, Tool, ToolCall, ToolCallStream,  # noqa: E402
                                          calls_text, detect_format, parse_tool_calls, tool_call_grammar)

WEATHER = Tool("get_weather", "weather", {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False})
ADD = Tool("add", "sum", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                          "required": ["a", "b"], "additionalProperties": False})
TOOLS = [WEATHER, ADD]
ONE = [ToolCall("get_weather", '{"city": "Q\\"uébec }", "unit": "c"}')]
TWO = ONE + [ToolCall("add", '{"a": 1, "b": -2}')]


def streamed(text, fmt, step, allow_text=True, tools=TOOLS):
    stream = ToolCallStream(fmt, tools, allow_text)
    pieces = [p for i in range(0, len(text), step) for p in stream.feed(text[i:i + step])]
    last, calls = stream.finish(text)
    return pieces + last, calls


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=list(FORMATS))
@pytest.mark.parametrize("calls", [ONE, TWO], ids=["one", "two"])
def test_calls_round_trip_whole_and_in_every_cut(fmt, calls):
    text = calls_text(calls, fmt)
    assert parse_tool_calls(text, fmt, TOOLS) == calls
    for step in (1, 3, len(text)):
        pieces, parsed = streamed(text, fmt, step)
        assert parsed == calls, (step, pieces)
        names = [(t, i) for k, t, i in pieces if k == "name"]
        assert names == [(c.name, i) for i, c in enumerate(calls)]
        for i, call in enumerate(calls):
            assert "".join(t for k, t, j in pieces if k == "arguments" and j == i) == call.arguments, (step, i)
        assert not [p for p in pieces if p[0] == "content"]


@pytest.mark.parametrize("text, fmt", [
    (' [{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "add", "arguments": {"a": 3, "b": 4}}]', "mistral"),
    ('[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "add", "arguments": {"a": 3, "b": 4}}]',
     "mistral"),
    ('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "add", "parameters": {"a": 3, "b": 4}}',
     "llama3"),
    ('\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n', "hermes"),
])
def test_markers_dropped_as_special_tokens_or_written_otherwise(text, fmt):
    want = [ToolCall("add", '{"a": 1, "b": 2}'), ToolCall("add", '{"a": 3, "b": 4}')]
    assert parse_tool_calls(text, FORMATS[fmt], TOOLS) == want
    pieces, calls = streamed(text, FORMATS[fmt], 2)
    assert calls == want and [i for k, _, i in pieces if k == "name"] == [0, 1]


HOSTILE = {
    "cut-off JSON": '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b"',
    "cut-off second call": '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n<tool_call>\n{"na',
    "unknown tool": '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',
    "one unknown of two": ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
                           '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'),
    "prose before": 'Sure! <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
    "prose after": '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call> done.',
    "arguments a list": '<tool_call>\n{"name": "add", "arguments": [1, 2]}\n</tool_call>',
    "extra key": '<tool_call>\n{"name": "add", "arguments": {}, "id": 3}\n</tool_call>',
    "name not a string": '<tool_call>\n{"name": 7, "arguments": {}}\n</tool_call>',
    "not JSON": "<tool_call>\n{name: add}\n</tool_call>",
    "bare marker": "<tool_call>",
    "empty": "",
    "a number": "42",
}


def test_named_calls_with_their_markers_dropped_as_special_tokens():
    # under `auto` such text starts like prose; `required` and named calls still stream
    want = [ToolCall("add", '{"a": 1, "b": 2}'), ToolCall("add", '{"a": 3, "b": 4}')]
    text = 'add{"a": 1, "b": 2}add{"a": 3, "b": 4}'
    assert parse_tool_calls(text, FORMATS["deepseek_v3"], TOOLS) == want
    pieces, calls = streamed(text, FORMATS["deepseek_v3"], 2, allow_text=False)
    assert calls == want and [i for k, _, i in pieces if k == "name"] == [0, 1]


NAMED_HOSTILE = {
    "cut-off JSON": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>{\"a\": 1, \"b\"",
    "unknown tool": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>rm_rf<｜tool▁sep｜>{}<｜tool▁call▁end｜>",
    "arguments a list": "<｜tool▁call▁begin｜>add<｜tool▁sep｜>[1, 2]<｜tool▁call▁end｜>",
    "prose before": "Sure! <｜tool▁call▁begin｜>add<｜tool▁sep｜>{\"a\": 1, \"b\": 2}<｜tool▁call▁end｜>",
    "prose after": "<｜tool▁call▁begin｜>add<｜tool▁sep｜>{\"a\": 1, \"b\": 2}<｜tool▁call▁end｜> done.",
    "name with a space": "<｜tool▁call▁begin｜>a dd<｜tool▁sep｜>{}<｜tool▁call▁end｜>",
    "bare marker": "<｜tool▁calls▁begin｜>",
}


R1_CALL = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n{}\n```<｜tool▁call▁end｜>"
R1_HOSTILE = {
    "cut-off JSON": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n{\"a\": 1, \"b\"",
    "unknown tool": "<｜tool▁calls▁begin｜>" + R1_CALL.replace(">add", ">rm_rf"),
    "arguments a list": R1_CALL.replace("{}", "[1, 2]"),
    "prose before": "Sure! " + R1_CALL,
    "prose after": R1_CALL + " done.",
    "another fence": R1_CALL.replace("```json", "```python"),
    "V3.1's layout": "<｜tool▁call▁begin｜>add<｜tool▁sep｜>{}<｜tool▁call▁end｜>",
    "bare marker": "<｜tool▁calls▁begin｜>",
}


def test_r1_calls_with_their_markers_dropped_as_special_tokens():
    want = [ToolCall("add", '{"a": 1, "b": 2}'), ToolCall("add", '{"a": 3, "b": 4}')]
    text = 'functionadd\n```json\n{"a": 1, "b": 2}\n```\nfunctionadd\n```json\n{"a": 3, "b": 4}\n```'
    assert parse_tool_calls(text, FORMATS["deepseek_r1"], TOOLS) == want
    pieces, calls = streamed(text, FORMATS["deepseek_r1"], 2, allow_text=False)
    assert calls == want and [i for k, _, i in pieces if k == "name"] == [0, 1]


@pytest.mark.parametrize("fmt, name", [("deepseek_v3", n) for n in NAMED_HOSTILE] +
                         [("deepseek_r1", n) for n in R1_HOSTILE])
def test_hostile_outputs_are_plain_text_when_the_name_is_outside_the_json(fmt, name):
    text, fmt = (NAMED_HOSTILE if fmt == "deepseek_v3" else R1_HOSTILE)[name], FORMATS[fmt]
    assert parse_tool_calls(text, fmt, TOOLS) is None
    for allow_text in (True, False):
        pieces, calls = streamed(text, fmt, 3, allow_text)
        content = "".join(t for k, t, _ in pieces if k == "content")
        called = [p for p in pieces if p[0] == "name"]
        assert calls is None and (content == text or (called and not content)), (pieces, allow_text)


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_outputs_are_plain_text(name):
    text = HOSTILE[name]
    assert parse_tool_calls(text, FORMATS["hermes"], TOOLS) is None
    for allow_text in (True, False):
        pieces, calls = streamed(text, FORMATS["hermes"], 3, allow_text)
        assert calls is None
        content = "".join(t for k, t, _ in pieces if k == "content")
        called = [p for p in pieces if p[0] == "name"]
        assert content == text or (called and not content), (pieces, allow_text)      # never both, nothing lost


def test_unknown_name_is_never_streamed_as_a_call():
    pieces, calls = streamed('{"name": "rm_rf", "arguments": {"path": "/"}}', FORMATS["json"], 1)
    assert calls is None and not [p for p in pieces if p[0] in ("name", "arguments")]


@pytest.mark.parametrize("template, name", [
    ("{% for t in tools %}<tool_call>{% endfor %}", "hermes"),
    ("{% if tools %}[TOOL_CALLS] [{% endif %}", "mistral"),
    ('{% if tools %}{"name": function name, "parameters": dictionary}{% endif %}', "llama3"),
    ("{{ messages }}", "json"),
    ("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['function']['name'] + '<｜tool▁sep｜>'}}", "deepseek_v3"),
    ("{{'<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json'}}",
     "deepseek_r1"),
])
def test_parser_chosen_from_the_template_or_forced(template, name):
    assert detect_format(template).name == name
    assert detect_format(template, "mistral").name == "mistral"
    with pytest.raises(KeyError):
        detect_format(template, "nonsense")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(test_model_path("smollm2"))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, len(tokenizer), {tokenizer.eos_token_id})


def accepts(compiler, spec, text, tokenizer):
    matcher = compiler.matcher(spec)
    return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=list(FORMATS))
def test_parallel_grammar(compiler, tokenizer, fmt):
    parallel = tool_call_grammar(TOOLS, fmt, allow_text=False)
    single = tool_call_grammar(TOOLS, fmt, allow_text=False, parallel=False)
    auto = tool_call_grammar(TOOLS, fmt, allow_text=True)
    for spec in (parallel, single, auto):
        assert accepts(compiler, spec, calls_text(ONE, fmt), tokenizer)
    assert accepts(compiler, parallel, calls_text(TWO, fmt), tokenizer)
    assert accepts(compiler, auto, calls_text(TWO, fmt), tokenizer)
    assert not accepts(compiler, single, calls_text(TWO, fmt), tokenizer)
    assert accepts(compiler, parallel, calls_text(ONE * MAX_CALLS, fmt), tokenizer)
    assert not accepts(compiler, parallel, calls_text(ONE * (MAX_CALLS + 1), fmt), tokenizer)
    assert not accepts(compiler, parallel, calls_text(ONE, fmt) + " and more", tokenizer)


def test_a_special_token_inside_a_marker_is_forced_as_that_token(tokenizer):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(test_model_path("smollm2"))
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    spec = tool_call_grammar([ADD], FORMATS["mistral"], allow_text=False, tokenizer=tok)
    assert f'<[{tok.convert_tokens_to_ids("[TOOL_CALLS]")}]> " ["' in spec.grammar


def _chat(**body):
    return ChatCompletionRequest.model_validate(body, strict=False)


PAST = [{"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}},
            {"id": "toolu_é2", "type": "function", "function": {"name": "add", "arguments": '{"a": 3, "b": 4}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"},
        {"role": "tool", "tool_call_id": "toolu_é2", "content": "7"}]
TOOL = {"type": "function", "function": {"name": "add", "parameters": ADD.parameters}}


class _Tok:
    def __init__(self, template):
        self.chat_template = template


def test_llama3_gets_one_call_per_assistant_turn():
    messages, tools = template_inputs(_chat(messages=PAST, tools=[TOOL]), _Tok(None), None, "llama3")
    turns = [m for m in messages if m["role"] == "assistant"]
    assert [len(t["tool_calls"]) for t in turns] == [1, 1] and tools is None
    assert [t["tool_calls"][0]["function"]["arguments"] for t in turns] == [{"a": 1, "b": 2}, {"a": 3, "b": 4}]


def test_mistral_ids_are_nine_alphanumerics_and_match_their_results():
    req = _chat(messages=PAST, tools=[TOOL])
    messages, _ = template_inputs(req, _Tok(None), tool_use(req, _Tok(None), "mistral"), "mistral")
    ids = [c["id"] for c in messages[1]["tool_calls"]]
    assert all(len(i) == 9 and i.isascii() and i.isalnum() for i in ids) and len(set(ids)) == 2
    assert [m["tool_call_id"] for m in messages[2:]] == ids


def test_parallel_tool_calls_false_allows_one_call(compiler, tokenizer):
    req = _chat(messages=PAST[:1], tools=[TOOL], tool_choice="required", parallel_tool_calls=False)
    use = tool_use(req, tokenizer, "json")
    two = calls_text([ToolCall("add", '{"a": 1, "b": 2}')] * 2, use.fmt)
    assert not accepts(compiler, use.grammar, two, tokenizer)
    use = tool_use(_chat(messages=PAST[:1], tools=[TOOL], tool_choice="required"), tokenizer, "json")
    assert not accepts(compiler, use.grammar, two, tokenizer)       # json (no tools in the template): one by default
    req = _chat(messages=PAST[:1], tools=[TOOL], tool_choice="required", parallel_tool_calls=True)
    assert accepts(compiler, tool_use(req, tokenizer, "json").grammar, two, tokenizer)
    assert accepts(compiler, tool_use(_chat(messages=PAST[:1], tools=[TOOL], tool_choice="required"), tokenizer,
                                      "hermes").grammar, calls_text([ToolCall("add", '{"a": 1, "b": 2}')] * 2,
                                                                    FORMATS["hermes"]), tokenizer)


def test_r1_calls_are_written_as_its_real_template_writes_them():
    """DeepSeek-R1's own template (tests/data/chat_templates/deepseek_r1.jinja) renders an assistant turn's calls;
    ours (calls_text) are the same text, and read back as the same calls."""
    from pathlib import Path

    import jinja2

    template = (Path(__file__).resolve().parents[1] / "data" / "chat_templates" / "deepseek_r1.jinja").read_text()
    fmt = detect_format(template)
    assert fmt.name == "deepseek_r1" and fmt.describe_in_prompt
    turn = {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in TWO]}
    rendered = jinja2.Environment().from_string(template).render(
        messages=[{"role": "user", "content": "hi"}, turn], bos_token="", add_generation_prompt=False)
    written = rendered.split("<｜Assistant｜>", 1)[1].removesuffix("<｜end▁of▁sentence｜>")
    assert written == calls_text(TWO, fmt)
    assert parse_tool_calls(written, fmt, TOOLS) == TWO
