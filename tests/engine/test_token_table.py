"""engine.structured.token_table: the grammar's token table checked against what each tokenizer layout decodes,
rebuilt when llguidance misreads it, refused (422, logged at start-up) when it cannot be built; and a nested JSON
schema sampled at temperature 1 from random logits (FakeRunner) validating on every layout."""
from __future__ import annotations

import json
import logging

import pytest

torch = pytest.importorskip("torch")
jsonschema = pytest.importorskip("jsonschema")
llguidance = pytest.importorskip("llguidance")
import llguidance.hf  # noqa: E402

import token_layouts as layouts  # noqa: E402
from fakes import FakeModelConfig, FakeRunner, test_model_path  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.structured import compiler as compiler_module  # noqa: E402
from engine.structured.compiler import GrammarCompiler  # noqa: E402
from engine.structured.spec import GrammarError, json_schema_spec  # noqa: E402
from engine.structured.token_table import (TokenTableError, check_table, decoded_in_context,  # noqa: E402
                                           grammar_tokenizer, special_ids)

NESTED = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "pet": {"type": "object", "properties": {
        "kind": {"enum": ["cat", "dog", "raccoon"]},
        "legs": {"type": "integer", "minimum": 0, "maximum": 8},
        "note": {"type": "string", "maxLength": 6}},
        "required": ["kind", "legs", "note"], "additionalProperties": False},
    "tags": {"type": "array", "maxItems": 2, "items": {"type": "string", "maxLength": 4}}},
    "required": ["name", "pet", "tags"], "additionalProperties": False}
SAMPLES = 50


def smollm2_json():
    return test_model_path("smollm2") / "tokenizer.json"


def layout_tokenizer(name: str):
    if name in ("llama2", "mistral", "gemma", "metaspace"):
        return layouts.load(layouts.sentencepiece_json(name), "<eos>" if name == "gemma" else "</s>")
    data = json.loads(smollm2_json().read_text()) if name == "byte-level" else layouts.with_decoder(
        smollm2_json(), {"gguf": layouts.GGUF_DECODER, "unreadable": layouts.UNREADABLE_DECODER}[name])
    return layouts.load(data, "<|im_end|>")


def padded(tokenizer) -> int:
    """Model vocabularies are often padded past the tokenizer's (SmolLM2: 49,152)."""
    return -(-len(tokenizer) // 64) * 64 + 64


def sample_json(tokenizer, n: int = SAMPLES) -> list:
    vocab = padded(tokenizer)
    engine = LLMEngine(EngineConfig(), runner=FakeRunner(vocab, 2048, 16), model_config=FakeModelConfig(vocab, 2048),
                       tokenizer=tokenizer)
    spec = json_schema_spec(NESTED, "s")
    prompt = tokenizer.encode("Describe a pet as JSON:", add_special_tokens=False)
    params = [SamplingParams(max_new_tokens=400, grammar=spec, do_sample=True, temperature=1.0, seed=seed)
              for seed in range(n)]
    return engine.generate([prompt] * n, params)


@pytest.mark.parametrize("name, how", [
    ("llama2", "automatic"), ("mistral", "automatic"), ("gemma", "automatic"), ("byte-level", "automatic"),
    ("metaspace", "rebuilt"),       # llguidance: "can't determine decoder type: Metaspace"
    ("gguf", "rebuilt"),            # llguidance reads the byte-level `Ġ` as U+0120
])
def test_every_layout_gets_a_table_that_matches_its_decoding(name, how):
    tokenizer = layout_tokenizer(name)
    table, built = grammar_tokenizer(tokenizer, padded(tokenizer), [tokenizer.eos_token_id])
    assert built.startswith(how), built
    assert check_table(table, decoded_in_context(tokenizer), special_ids(tokenizer)).ok
    text = ' {"name": "caf\u00e9 \u2713", "n": [1, 2]}'
    # after a first token: a sentencepiece decoder strips the text's first space, which is no token's byte
    first = tokenizer.encode("a", add_special_tokens=False)[-1:]
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert table.decode_bytes(ids).decode() == tokenizer.decode(first + ids)[len(tokenizer.decode(first)):]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama2", "mistral", "gemma", "metaspace", "byte-level", "gguf"])
def test_nested_schema_validates_on_every_layout(name):
    tokenizer = layout_tokenizer(name)
    for out in sample_json(tokenizer):
        assert out.finish_reason == "eos_token", out.text
        jsonschema.validate(json.loads(out.text), NESTED)


def test_the_gguf_layout_breaks_json_with_llguidances_own_table(monkeypatch):
    # the reported bug, so the test above can fail: the unchecked table lets the model write invalid JSON
    def unchecked(hf_tokenizer, n_vocab, eos):
        return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=n_vocab, eos_token=eos), "automatic"
    monkeypatch.setattr(compiler_module, "grammar_tokenizer", unchecked)
    invalid = 0
    for out in sample_json(layout_tokenizer("gguf"), n=8):
        try:
            jsonschema.validate(json.loads(out.text), NESTED)
        except (ValueError, jsonschema.ValidationError):
            invalid += 1
    assert invalid > 0


def test_a_table_that_cannot_be_built_refuses_grammars_and_logs_it_at_start(caplog):
    tokenizer = layout_tokenizer("unreadable")      # a Regex `Replace` before ByteLevel: no bytes for `¡`
    with pytest.raises(TokenTableError, match=r"cannot be built for this tokenizer: llguidance misreads \d+ tokens"):
        grammar_tokenizer(tokenizer, padded(tokenizer), [tokenizer.eos_token_id])
    compiler = GrammarCompiler(tokenizer, padded(tokenizer), {tokenizer.eos_token_id})
    with caplog.at_level(logging.ERROR, logger="engine.structured.compiler"):
        compiler.prepare_in_background().join()
    assert "structured output (grammars, JSON schemas, tools) is refused" in caplog.text
    assert "token table cannot be built" in compiler.unavailable
    with pytest.raises(GrammarError, match="structured output is not available for this model"):
        compiler.matcher(json_schema_spec(NESTED, "s"))


def test_a_slow_tokenizer_is_refused_by_name():
    class Slow:
        eos_token_id = 2
    with pytest.raises(TokenTableError, match="needs a fast tokenizer .* is a Slow"):
        grammar_tokenizer(Slow(), 64, [2])


def test_special_tokens_stay_special():
    tokenizer = layout_tokenizer("gguf")
    table, _ = grammar_tokenizer(tokenizer, padded(tokenizer), [tokenizer.eos_token_id])
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert table.is_special_token(im_end)
    assert table.decode_bytes(tokenizer.encode("<|im_end|>x", add_special_tokens=False))[-1:] == b"x"


def test_the_server_refuses_grammar_requests_naming_the_cause():
    from starlette.testclient import TestClient
    from test_server import FakeEngine, make_app
    tokenizer = layout_tokenizer("unreadable")
    fake = FakeEngine()
    fake.grammars = GrammarCompiler(tokenizer, padded(tokenizer), {tokenizer.eos_token_id})
    fake.grammars.prepare_in_background().join()
    app, engine, _ = make_app(fake)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    try:
        with TestClient(app) as client:
            for route, body in [
                ("/generate", {"inputs": "ab", "parameters": {"grammar": {"type": "json", "value": {"type": "object"}}}}),
                ("/generate_stream", {"inputs": "ab", "parameters": {"grammar": {"type": "regex", "value": "a+"}}}),
                ("/v1/chat/completions", {**chat, "response_format": {"type": "json_object"}, "stream": True}),
                ("/v1/chat/completions", {**chat, "tool_choice": "required", "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}),
            ]:
                r = client.post(route, json=body)
                assert r.status_code == 422, (route, r.text)
                assert "structured output is not available for this model" in r.json()["error"]
                assert "token table cannot be built" in r.json()["error"]
            assert client.post("/generate", json={"inputs": "ab"}).status_code == 200     # the rest still works
    finally:
        engine.close()
