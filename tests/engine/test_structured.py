"""engine.structured: grammar specs and their errors, the compile cache, the step bitmask in the sampler, tool-call
grammars and their stream parser, and the engine under a grammar (random logits from FakeRunner, SmolLM2's
real tokenizer and llguidance) through chunked prefill, preemption, stop sequences and tensor parallelism."""
from __future__ import annotations

import json
import re

import pytest

torch = pytest.importorskip("torch")
jsonschema = pytest.importorskip("jsonschema")
llguidance = pytest.importorskip("llguidance")

from fakes import FakeModelConfig, FakeRunner, test_model_path  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampler import sample  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.structured.compiler import GrammarCompiler  # noqa: E402
from engine.structured.masks import TokenBitmask, apply_token_bitmask, masked_on_device  # noqa: E402
from engine.structured.spec import GrammarError, json_schema_spec, lark_spec, regex_spec  # noqa: E402
from engine.structured.tool_calls import (FORMATS, Tool, ToolCall, ToolCallStream, call_text,  # noqa: E402
                                          detect_format, parse_tool_call, tool_call_grammar)

VOCAB = 49152
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "kind": {"enum": ["cat", "dog", "raccoon"]},
    "legs": {"type": "integer", "minimum": 0, "maximum": 8},
    "tags": {"type": "array", "maxItems": 2, "items": {"type": "string", "maxLength": 4}}},
    "required": ["name", "kind", "legs", "tags"], "additionalProperties": False}
WEATHER = Tool("get_weather", "weather", {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False})
ADD = Tool("add", "sum", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                          "required": ["a", "b"], "additionalProperties": False})


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(test_model_path("smollm2"))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, VOCAB, {tokenizer.eos_token_id})


def accepts(compiler, spec, text: str, tokenizer) -> bool:
    """Whether the grammar accepts exactly `text` (tokenized as the model would) and then may end."""
    matcher = compiler.matcher(spec)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.consume_tokens(ids) and matcher.is_accepting()


# --- specs -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("schema, message", [
    ({"type": "objekt"}, "`f` is not a valid JSON schema"),
    ({"properties": {"a": {"minimum": "three"}}}, "(at `properties/a/minimum`)"),
    ({"type": "array", "uniqueItems": True}, 'cannot enforce: Unimplemented keys: ["uniqueItems"]'),
    ({"anyOf": [{"type": "string"}], "not": {"type": "integer"}}, 'Unimplemented keys: ["not"]'),
    ('{"type": ', "`f` is not valid JSON"),
    ([{"type": "object"}], "must be a JSON schema object, got list"),
    (17, "got int"),
])
def test_bad_json_schemas_name_the_field(schema, message):
    with pytest.raises(GrammarError, match=re.escape(message)):
        json_schema_spec(schema, "f")


@pytest.mark.parametrize("pattern", ["[a-", "(unclosed", "a{3,1}", "", None])
def test_bad_regexes(pattern):
    with pytest.raises(GrammarError, match="`g`"):
        regex_spec(pattern, "g")


def test_the_same_schema_is_the_same_cache_key(compiler, tokenizer):
    assert json_schema_spec(SCHEMA, "a") == json_schema_spec(json.dumps(SCHEMA), "b")
    assert json_schema_spec(SCHEMA, "a") != json_schema_spec({**SCHEMA, "required": ["name"]}, "a")
    before = compiler.num_cached
    first, second = compiler.matcher(json_schema_spec(SCHEMA, "a")), compiler.matcher(json_schema_spec(SCHEMA, "a"))
    assert compiler.num_cached == before + 1
    # copies of one cached grammar: advancing one leaves the other at the start
    assert first.consume_tokens(tokenizer.encode('{"name": "x', add_special_tokens=False))
    assert accepts(compiler, json_schema_spec(SCHEMA, "a"), '{"name": "Rex", "kind": "dog", "legs": 4, "tags": []}',
                   tokenizer)
    assert second.consume_tokens(tokenizer.encode('{"name": "y', add_special_tokens=False))


def test_schema_enforcement(compiler, tokenizer):
    spec = json_schema_spec(SCHEMA, "s")
    assert not accepts(compiler, spec, '{"name": "Rex", "kind": "cow", "legs": 4, "tags": []}', tokenizer)
    assert not accepts(compiler, spec, '{"name": "Rex", "kind": "dog", "legs": 9, "tags": []}', tokenizer)
    assert not accepts(compiler, spec, '{"name": "Rex", "kind": "dog", "legs": 4}', tokenizer)
    assert not accepts(compiler, spec, '{"name": "Rexxxxxx", "kind": "dog", "legs": 4, "tags": []}', tokenizer)
    assert accepts(compiler, regex_spec(r"\d{4}-\d{2}-\d{2}", "r"), "2024-02-29", tokenizer)
    assert not accepts(compiler, regex_spec(r"\d{4}-\d{2}-\d{2}", "r"), "2024-2-29", tokenizer)


# --- the bitmask in the sampler ----------------------------------------------------------------------------

class Row:
    def __init__(self, params):
        self.params, self.token_ids, self.num_prompt_tokens, self.seed, self.generator = params, [1], 1, 5, None


def bitmask_allowing(allowed: list[set[int]], vocab: int) -> torch.Tensor:
    bits = torch.zeros(len(allowed), (vocab + 31) // 32, dtype=torch.int64)
    for r, ids in enumerate(allowed):
        for t in ids:
            bits[r, t // 32] |= 1 << (t % 32)
    return bits.to(torch.int32) if bits.max() < 2**31 else (bits - (bits >= 2**31) * 2**32).to(torch.int32)


def test_bitmask_rows_greedy_and_sampled():
    vocab = 100
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    allowed = [{3, 31, 32, 63}, {99, 64}]
    mask = TokenBitmask([0, 2], bitmask_allowing(allowed, vocab))
    greedy = sample(logits, [Row(SamplingParams())] * 3, mask).token_ids
    assert greedy[0] == max(allowed[0], key=lambda t: logits[0, t]) and greedy[2] in allowed[1]
    assert greedy[1] == int(logits[1].argmax())          # unmasked row untouched
    rows = [Row(SamplingParams(do_sample=True, temperature=5.0, seed=s)) for s in range(3)]
    for seed in range(40):
        for row in rows:
            row.generator, row.seed = None, seed
        picked = sample(logits, rows, mask).token_ids
        assert picked[0] in allowed[0] and picked[2] in allowed[1]


@pytest.mark.parametrize("apply", [apply_token_bitmask, masked_on_device], ids=["cpu", "unpacked-on-device"])
def test_bitmask_hostile_shapes(apply):
    scores = torch.zeros(2, 70)                          # logits wider than the tokenizer's mask (2 words = 64)
    out = apply(scores, TokenBitmask([0, 1], bitmask_allowing([{5}, set()], 64)))
    assert torch.isfinite(out[0]).tolist() == [i == 5 for i in range(70)]
    assert torch.isfinite(out[1]).all()                  # nothing allowed (a matcher bug): left unconstrained
    assert torch.equal(scores, torch.zeros(2, 70))       # the input is not modified


# --- tool calls --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("template, name", [
    (None, "json"), ("{{ messages }}", "json"),
    ("{% if tools %}<tool_call>{{ tools | tojson }}</tool_call>{% endif %}", "hermes"),
    ("{% if tools %}[AVAILABLE_TOOLS]{{ tools }}[TOOL_CALLS]{% endif %}", "mistral"),
    ("{% if tools %}<tool_call>{% endif %}", "hermes"),
    ('{% if tools %}<|python_tag|>{"name": x, "parameters": y}{% endif %}', "llama3"),
])
def test_detect_format(template, name):
    assert detect_format(template).name == name


def test_required_and_auto_grammars(compiler, tokenizer):
    fmt = FORMATS["json"]
    required = tool_call_grammar([WEATHER, ADD], fmt, allow_text=False)
    auto = tool_call_grammar([WEATHER, ADD], fmt, allow_text=True)
    good = call_text(ToolCall("get_weather", '{"city": "Paris", "unit": "c"}'), fmt)
    bad_args = call_text(ToolCall("get_weather", '{"city": "Paris", "unit": "kelvin"}'), fmt)
    unknown = call_text(ToolCall("delete_all", "{}"), fmt)
    for spec in (required, auto):
        assert accepts(compiler, spec, good, tokenizer)
        assert accepts(compiler, spec, call_text(ToolCall("add", '{"a": 1, "b": -2}'), fmt), tokenizer)
        assert not accepts(compiler, spec, bad_args, tokenizer)
        assert not accepts(compiler, spec, unknown, tokenizer)
    assert not accepts(compiler, required, "It is sunny.", tokenizer)
    assert accepts(compiler, auto, "It is sunny.", tokenizer)
    assert not accepts(compiler, auto, ' {"name": "get_weather"', tokenizer)   # a call cannot hide as text


def test_special_token_marker_is_forced_as_the_token(tokenizer):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(test_model_path("smollm2"))
    tok.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    spec = tool_call_grammar([ADD], FORMATS["hermes"], allow_text=False, tokenizer=tok)
    ids = tok.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])
    assert f"<[{ids[0]}]>" in spec.grammar and f"<[{ids[1]}]>" in spec.grammar
    # read back from the text the detokenizer gives (special tokens dropped)
    assert parse_tool_call('\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n', FORMATS["hermes"], [ADD]) == \
        ToolCall("add", '{"a": 1, "b": 2}')


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=list(FORMATS))
@pytest.mark.parametrize("step", [1, 2, 7])
def test_stream_pieces_concatenate_to_the_arguments(fmt, step):
    call = ToolCall("get_weather", '{"city": "Q\\"uébec }", "unit": "c"}')
    text = call_text(call, fmt)
    stream = ToolCallStream(fmt, [WEATHER], allow_text=True)
    pieces = [p for i in range(0, len(text), step) for p in stream.feed(text[i:i + step])]
    last, parsed = stream.finish(text)
    pieces += last
    assert parsed == [call] and pieces[0] == ("name", "get_weather", 0)
    assert [(k, i) for k, _, i in pieces[1:]] == [("arguments", 0)] * (len(pieces) - 1)
    assert "".join(t for _, t, _ in pieces[1:]) == call.arguments


def test_stream_plain_text_under_auto():
    stream = ToolCallStream(FORMATS["json"], [WEATHER], allow_text=True)
    assert stream.feed("") == [] and stream.feed("Sun") == [("content", "Sun", 0)] and stream.feed("ny {") == \
        [("content", "ny {", 0)]
    assert stream.finish("Sunny {") == ([], None)


def test_parse_rejects_what_is_not_a_call():
    fmt = FORMATS["json"]
    for text in ['{"name": "get_weather"}', '{"name": "nope", "arguments": {}}', "hello",
                 '{"name": "get_weather", "arguments": [1]}', '{"name": "get_weather", "arguments": {}, "x": 1}']:
        assert parse_tool_call(text, fmt, [WEATHER]) is None


def test_bad_lark_is_a_grammar_error():
    with pytest.raises(GrammarError, match="`tools`"):
        lark_spec("start: ( unclosed", "tools")


# --- the engine --------------------------------------------------------------------------------------------

def make_engine(tokenizer, num_kv_blocks=512, block_size=4, **config):
    runner = FakeRunner(VOCAB, num_kv_blocks, block_size)
    engine = LLMEngine(EngineConfig(**config), runner=runner, model_config=FakeModelConfig(VOCAB, 512),
                       tokenizer=tokenizer)
    return engine, runner


def test_engine_random_logits_always_give_valid_json(tokenizer):
    engine, _ = make_engine(tokenizer, max_batch_prefill_tokens=8)        # prompts arrive in chunks
    spec = json_schema_spec(SCHEMA, "s")
    prompts = [tokenizer.encode(f"Describe animal number {i} of the zoo in JSON please, thank you:") for i in range(6)]
    params = [SamplingParams(max_new_tokens=80, grammar=spec, do_sample=i % 2 == 1, seed=i) for i in range(6)]
    for out in engine.generate(prompts, params):
        assert out.finish_reason == "eos_token", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert engine.scheduler.num_preempted_total == 0


def test_engine_grammar_survives_preemption(tokenizer):
    # 8 sequences that together need more KV blocks than exist: the newest are preempted and recomputed
    engine, _ = make_engine(tokenizer, num_kv_blocks=40, block_size=4)
    spec = json_schema_spec(SCHEMA, "s")
    prompts = [tokenizer.encode(f"Animal {i}:") for i in range(8)]
    outs = engine.generate(prompts, [SamplingParams(max_new_tokens=60, grammar=spec, do_sample=True, seed=i)
                                     for i in range(8)])
    assert engine.scheduler.num_preempted_total > 0
    for out in outs:
        assert out.finish_reason == "eos_token", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_engine_length_stop_sequence_and_mixed_batch(tokenizer):
    engine, _ = make_engine(tokenizer)
    never_done = json_schema_spec({"type": "array", "items": {"type": "integer"}, "minItems": 100}, "s")
    date = regex_spec(r"(19|20)\d\d-(0[1-9]|1[0-2])-[0-2]\d", "r")
    prompts = [tokenizer.encode(p) for p in ("Numbers:", "A date:", "Free text:", "Pets:")]
    outs = engine.generate(prompts, [
        SamplingParams(max_new_tokens=5, grammar=never_done),
        SamplingParams(max_new_tokens=20, grammar=date),
        SamplingParams(max_new_tokens=6, ignore_eos=True),
        SamplingParams(max_new_tokens=40, grammar=json_schema_spec(SCHEMA, "s"), stop=['"kind"'])])
    assert outs[0].finish_reason == "length" and outs[0].text.startswith("[")
    assert outs[1].finish_reason == "eos_token" and re.fullmatch(r"(19|20)\d\d-(0[1-9]|1[0-2])-[0-2]\d", outs[1].text)
    assert outs[2].finish_reason == "length" and len(outs[2].tokens) == 6
    assert outs[3].finish_reason == "stop_sequence" and outs[3].text.startswith('{"name": "')


def test_engine_refuses_a_grammar_the_tokenizer_cannot_use(tokenizer):
    engine, _ = make_engine(tokenizer)
    # a special token that this vocabulary does not have
    with pytest.raises(GrammarError):
        engine.add_request("r", [1, 2], SamplingParams(grammar=lark_spec("start: <[999999]>", "g")))
    assert not engine.has_unfinished_requests()


@pytest.mark.slow
def test_tensor_parallel_rank0_samples_under_the_grammar(model_path):
    path = model_path("tiny-llama")
    config = dict(model_id=str(path), device="cpu", block_size=4, cpu_kv_cache_bytes=2**20, master_port=0)
    spec = regex_spec(r"[a-z]{3,8}( [a-z]{3,8}){2}", "r")
    outs = {}
    for num_shard in (1, 2):
        with LLMEngine(EngineConfig(num_shard=num_shard, **config)) as engine:
            prompts = [engine.tokenizer.encode("hello"), engine.tokenizer.encode("the cat")]
            params = SamplingParams(max_new_tokens=40, grammar=spec)
            outs[num_shard] = [o.text for o in engine.generate(prompts, params)]
    assert outs[1] == outs[2]
    for text in outs[2]:
        assert re.fullmatch(r"[a-z]{3,8}( [a-z]{3,8}){2}", text), outs


def test_tool_arguments_are_closed_to_undeclared_properties(compiler, tokenizer):
    # issue 25: SmolLM2 under "required" invented arguments ("unitStyle", "apiKey", ...) a tool without
    # additionalProperties allows, and could go on until max_tokens cut the call off
    open_tool = Tool("get_weather", "w", {"type": "object", "properties": {
        "city": {"type": "string"}, "where": {"type": "object", "properties": {"lat": {"type": "number"}}}},
        "required": ["city"]})
    spec = tool_call_grammar([open_tool], FORMATS["json"], allow_text=False)
    assert accepts(compiler, spec, '{"name": "get_weather", "arguments": {"city": "Paris", "where": {"lat": 1}}}',
                   tokenizer)
    for extra in ('{"city": "Paris", "unitStyle": "x"}', '{"city": "Paris", "where": {"lat": 1, "lon": 2}}'):
        assert not accepts(compiler, spec, f'{{"name": "get_weather", "arguments": {extra}}}', tokenizer)
    # a schema that opens them on purpose keeps them open
    free = Tool("f", "", {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True})
    spec = tool_call_grammar([free], FORMATS["json"], allow_text=False)
    assert accepts(compiler, spec, '{"name": "f", "arguments": {"a": 1, "b": 2}}', tokenizer)


def test_grammars_go_ahead_under_async_scheduling_with_the_synchronous_tokens(tokenizer):
    """A step ahead is launched before N's tokens are known; its masks are filled once they are appended (the
    matchers advanced), then it is picked: the same valid outputs as the synchronous engine, through chunked
    prompts, penalties, sampling and requests the grammar ends while their next row is in flight."""
    spec = json_schema_spec(SCHEMA, "s")
    date = regex_spec(r"(19|20)\d\d-(0[1-9]|1[0-2])-[0-2]\d", "r")
    prompts = [tokenizer.encode(f"Describe animal number {i} of the zoo in JSON please:") for i in range(5)]
    prompts += [tokenizer.encode("A date:"), tokenizer.encode("Free text:")]
    params = [SamplingParams(max_new_tokens=80, grammar=spec, do_sample=i % 2 == 1, seed=i,
                             repetition_penalty=1.3 if i == 2 else None, top_n_tokens=2 if i == 3 else 0)
              for i in range(5)]
    params += [SamplingParams(max_new_tokens=20, grammar=date), SamplingParams(max_new_tokens=30, ignore_eos=True)]
    finals, ahead = {}, {}
    for mode in ("off", "on"):
        engine, _ = make_engine(tokenizer, max_batch_prefill_tokens=8, async_scheduling=mode)
        outs = engine.generate(prompts, params)
        finals[mode] = [([t.id for t in o.tokens], o.text, o.finish_reason,
                         [[(a.id, round(a.logprob, 3)) for a in t.top_tokens] for t in o.tokens]) for o in outs]
        ahead[mode] = engine.stats().num_steps_ahead_total
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        for out in outs[:5]:
            assert out.finish_reason == "eos_token", out.text
            jsonschema.validate(json.loads(out.text), SCHEMA)
        assert re.fullmatch(r"(19|20)\d\d-(0[1-9]|1[0-2])-[0-2]\d", outs[5].text)
    assert finals["on"] == finals["off"]
    assert ahead["off"] == 0 and ahead["on"] > 20
