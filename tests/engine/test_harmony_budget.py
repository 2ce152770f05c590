"""A reasoning budget for gpt-oss (harmony): the analysis message ends at its budget, the grammar then forces
`<|end|><|start|>assistant<|channel|>final<|message|>` (as `</think>` for the other parsers) and the final
message's grammar (response_format, tools) applies. Checked token by token with llguidance, and in-process (the
real engine) on tiny-gpt-oss given harmony's markers as special tokens and a harmony template, with the real
`openai` and `anthropic` clients on chat, Responses and Messages, streamed and not: the analysis is the
reasoning, within the budget, and the final channel is the content, JSON that validates."""
from __future__ import annotations

import json
import shutil
import time

import pytest

pytest.importorskip("torch")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

MARKERS = ["<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>", "<|return|>"]
# harmony's layout as gpt-oss's template writes it: a system message with the reasoning effort, the turns, and
# `<|start|>assistant` as the generation prompt (the model writes each message's channel header itself)
TEMPLATE = ("{{- '<|start|>system<|message|>Reasoning: ' + (reasoning_effort or 'medium') + '\\n\\n'"
            " + '# Valid channels: analysis, commentary, final.<|end|>' -}}"
            "{%- if tools %}{{- '<|start|>developer<|message|># Tools\\n\\nnamespace functions {\\n' -}}"
            "{%- for t in tools %}{{- 'type ' + t.function.name + ' = (_: any) => any;\\n' -}}{%- endfor %}"
            "{{- '} // namespace functions<|end|>' -}}{%- endif %}"
            "{%- for m in messages %}{%- if m.role == 'assistant' %}"
            "{{- '<|start|>assistant<|channel|>final<|message|>' + (m.content or '') + '<|end|>' -}}"
            "{%- else %}{{- '<|start|>' + m.role + '<|message|>' + (m.content or '') + '<|end|>' -}}{%- endif %}"
            "{%- endfor %}{%- if add_generation_prompt %}{{- '<|start|>assistant' -}}{%- endif %}")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"enum": [1, 2, 3]}, "b": {"enum": [4, 5, 6]}}, "required": ["a", "b"],
       "additionalProperties": False}
ASK = [{"role": "user", "content": "Think, then answer."}]


@pytest.fixture(scope="module")
def folder(model_path, tmp_path_factory):
    """tiny-gpt-oss with harmony's markers added as special tokens (random rows appended to its embedding and LM
    head), the harmony template, and `<|return|>` / `<|call|>` as end tokens, as gpt-oss's generation_config has
    them."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer, GenerationConfig
    folder = tmp_path_factory.mktemp("gpt-oss") / "tiny-gpt-oss"
    shutil.copytree(model_path("tiny-gpt-oss"), folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_special_tokens({"additional_special_tokens": MARKERS})
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(folder)
    weights = load_file(folder / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        rows = weights[name]
        grown = torch.randn(len(tokenizer) - rows.shape[0], rows.shape[1], generator=generator) * rows.std()
        weights[name] = torch.cat([rows, grown])
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": len(tokenizer)}))
    ends = tokenizer.convert_tokens_to_ids(["<|return|>", "<|call|>"])
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=[tokenizer.eos_token_id, *ends],
                     pad_token_id=tokenizer.pad_token_id, do_sample=False).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tokenizer(folder):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def http(folder):
    """The server in-process (the real engine, Starlette's TestClient): --reasoning-parser auto reads the
    template's `<|channel|>`."""
    from starlette.testclient import TestClient

    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.server.app import build_app
    config = EngineConfig(model_id=str(folder), served_model_name="tiny", device="cpu", dtype="float32",
                          cpu_kv_cache_bytes=8 * 2**20)
    engine = AsyncEngine(LLMEngine(config)).start()
    try:
        with TestClient(build_app(engine, config)) as client:
            yield client
            blocks = engine.engine.block_manager
            for _ in range(100):        # the engine thread frees the last request's blocks after its reply
                if blocks.num_free_blocks == blocks.num_blocks:
                    break
                time.sleep(0.05)
            assert blocks.num_free_blocks == blocks.num_blocks
    finally:
        engine.close()


@pytest.fixture(scope="module")
def client(http):
    return openai.OpenAI(base_url=str(http.base_url).rstrip("/") + "/v1", api_key="x", http_client=http,
                         max_retries=0)


def test_the_grammar_closes_the_analysis_at_its_budget_then_forces_the_final_header(tokenizer):
    llguidance = pytest.importorskip("llguidance")
    import llguidance.hf

    from engine.server.harmony import final_grammar
    from engine.server.reasoning import answer_rules
    table = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))
    answer = answer_rules(None, SCHEMA)
    budgeted, free = (final_grammar(answer, budget, tokenizer, "response_format") for budget in (3, None))
    start, channel, message, end = tokenizer.convert_tokens_to_ids(["<|start|>", "<|channel|>", "<|message|>",
                                                                   "<|end|>"])

    def matcher(text: str, spec=budgeted):
        """The matcher after `text`, or None where the grammar refuses it."""
        found = llguidance.LLMatcher(table, llguidance.LLMatcher.grammar_from_lark(spec.grammar), log_level=0)
        ok = all(found.consume_token(t) for t in tokenizer.encode(text, add_special_tokens=False))
        return found if ok else None

    def allowed(found) -> list[int]:
        bits = found.compute_bitmask()
        return [i for i in range(len(tokenizer)) if bits[i // 8] >> (i % 8) & 1]

    full = matcher("<|channel|>analysis<|message|>" + "".join(tokenizer.decode([t]) for t in range(300, 303)))
    for marker, text in [(end, ""), (start, "assistant"), (channel, "final"), (message, "")]:
        assert allowed(full) == [marker]        # the budget is spent: <|end|>, then the final message's header
        assert full.consume_token(marker)
        assert all(full.consume_token(t) for t in tokenizer.encode(text, add_special_tokens=False))
    assert allowed(matcher("<|channel|>analysis<|message|>x")) != [end]     # within the budget: free
    ended = matcher("<|channel|>analysis<|message|>x<|end|><|start|>assistant")
    assert tokenizer.decode(ended.compute_ff_tokens()).startswith("<|channel|>final<|message|>")   # no 2nd analysis
    answered = '<|channel|>final<|message|>{"name": "Ada", "age": 36}'
    assert matcher("<|channel|>analysis<|message|><|end|><|start|>assistant" + answered).is_accepting()
    assert matcher(answered) is None and matcher(answered, free).is_accepting()    # a budget asks for the analysis
    assert matcher(answered.replace('"Ada"', "3"), free) is None                    # the final message's schema
    assert matcher("<|channel|>analysis<|message|>" + "x" * 40, free) is not None  # no budget: no limit


def test_tool_grammars_take_the_budget_too(tokenizer):
    """`required` (a call) and `auto` under a budget (a call or a final message), each after a bounded analysis."""
    llguidance = pytest.importorskip("llguidance")
    import llguidance.hf

    from engine.server.harmony import call_grammar
    from engine.structured.tool_calls import Tool
    table = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))
    call = '<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 1, "b": 4}<|call|>'
    thought = "<|channel|>analysis<|message|>{}<|end|><|start|>assistant"
    final = "<|channel|>final<|message|>Five."

    def accepts(spec, text: str) -> bool:
        found = llguidance.LLMatcher(table, llguidance.LLMatcher.grammar_from_lark(spec.grammar), log_level=0)
        return all(found.consume_token(t) for t in tokenizer.encode(text, add_special_tokens=False)) and \
            found.is_accepting()

    required, auto = (call_grammar([Tool("add", "", ADD)], tokenizer, budget=2, allow_text=text) for text in (0, 1))
    assert accepts(required, thought.format("a b") + call) and accepts(auto, thought.format("a b") + call)
    assert accepts(auto, thought.format("") + final) and not accepts(required, thought.format("") + final)
    assert not accepts(required, thought.format("a b c d e f") + call)      # past the budget
    assert not accepts(required, call) and not accepts(auto, final)           # a budget asks for the analysis
    assert accepts(call_grammar([Tool("add", "", ADD)], tokenizer), call)    # (without one it is optional)


def reasoning_tokens(tokens: list[str]) -> int:
    """Tokens between the analysis message's `<|message|>` and its `<|end|>` (all of them when cut off)."""
    if tokens[:1] != ["<|channel|>"] or "<|message|>" not in tokens:
        return 0
    if "".join(tokens[1:tokens.index("<|message|>")]) != "analysis":
        return 0
    body = tokens[tokens.index("<|message|>") + 1:]
    return body.index("<|end|>") if "<|end|>" in body else len(body)


def test_chat_budget_then_json_streamed_and_not(client):
    budget = 3
    kwargs = dict(model="tgi", messages=ASK, max_tokens=48, temperature=1.0,
                  extra_body={"max_reasoning_tokens": budget},
                  response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}})
    spent = []
    for seed in range(2):
        choice = client.chat.completions.create(**kwargs, seed=seed, logprobs=True).choices[0]
        assert choice.finish_reason == "stop", repr(choice.message.content)
        generated = [t.token for t in choice.logprobs.content]
        spent.append(reasoning_tokens(generated))
        assert 0 < spent[-1] <= budget, generated
        reasoning = choice.message.model_extra["reasoning_content"]
        assert reasoning and "<|" not in reasoning + choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        chunks = list(client.chat.completions.create(**kwargs, seed=seed, stream=True))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert "".join(d.content or "" for d in deltas) == choice.message.content
        assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == reasoning
    assert budget in spent, spent           # a random model does not end its analysis early: the budget does
    for hostile in (0, -1, 10**30, "3"):
        with pytest.raises(openai.UnprocessableEntityError) as info:
            client.chat.completions.create(**{**kwargs, "extra_body": {"max_reasoning_tokens": hostile}})
        assert info.value.body is None or "Traceback" not in str(info.value.body)


def test_messages_thinking_budget_then_text_streamed_and_not(http, client):
    anthropic = pytest.importorskip("anthropic")
    claude = anthropic.Anthropic(base_url=str(http.base_url), api_key="x", http_client=http, max_retries=0)
    kwargs = dict(model="tiny", max_tokens=24, messages=ASK, thinking={"type": "enabled", "budget_tokens": 4},
                  extra_body={"temperature": 0})     # (this SDK refuses `temperature` beside `thinking`)
    whole = claude.messages.create(**kwargs)
    assert [b.type for b in whole.content] == ["thinking", "text"], whole.content
    thinking, text = whole.content[0].thinking, whole.content[1].text
    assert thinking and text and "<|" not in thinking + text
    with claude.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    # the same greedy turn on the chat route, whose logprobs count the analysis message's tokens
    chat = client.chat.completions.create(model="tgi", messages=ASK, max_tokens=24, temperature=0, logprobs=True,
                                          extra_body={"max_reasoning_tokens": 4}).choices[0]
    assert chat.message.model_extra["reasoning_content"] == thinking and chat.message.content == text
    assert 0 < reasoning_tokens([t.token for t in chat.logprobs.content]) <= 4


def test_responses_reasoning_budget_then_json_or_a_call_streamed_and_not(client, tokenizer):
    markers = len(tokenizer.encode("<|channel|>analysis<|message|><|end|>", add_special_tokens=False))
    text = {"format": {"type": "json_schema", "name": "p", "schema": SCHEMA}}
    tool = {"type": "function", "name": "add", "parameters": ADD}
    for budget, extra, kinds in [(5, {"text": text}, ["reasoning", "message"]),
                                 (3, {"tools": [tool], "tool_choice": "required"}, ["reasoning", "function_call"])]:
        # (a call's header alone is ~25 tokens of this 1k vocabulary)
        kwargs = dict(model="tiny", input="Think, then answer.", max_output_tokens=96, temperature=0,
                      reasoning={"max_tokens": budget}, **extra)
        whole = client.responses.create(**kwargs)
        assert [item.type for item in whole.output] == kinds
        assert 0 < whole.usage.output_tokens_details.reasoning_tokens - markers <= budget
        if "text" in extra:
            jsonschema.validate(json.loads(whole.output_text), SCHEMA)
        else:
            jsonschema.validate(json.loads(whole.output[-1].arguments), ADD)
        events = list(client.responses.create(**kwargs, stream=True))
        final = events[-1].response
        assert [i.type for i in final.output] == kinds and final.output_text == whole.output_text
        streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert streamed == whole.output[0].content[0].text and "<|" not in streamed


def test_responses_effort_reaches_the_template(client, tokenizer):
    """`reasoning.effort` is gpt-oss's `reasoning_effort` ("Reasoning: low" in its system message) as well as a
    budget."""
    def rendered(effort: str) -> int:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi."}], tokenize=False,
                                               add_generation_prompt=True, reasoning_effort=effort)
        return len(tokenizer.encode(prompt, add_special_tokens=False))

    used = {effort: client.responses.create(model="tiny", input="Hi.", max_output_tokens=1,
                                            reasoning={"effort": effort}).usage.input_tokens
            for effort in ("low", "high")}
    assert used == {"low": rendered("low"), "high": rendered("high")} and used["low"] != used["high"]
