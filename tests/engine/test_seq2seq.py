"""Encoder-decoder models (engine/seq2seq/) against transformers (fp32, CPU) on a tiny random flan-t5-shaped
checkpoint (scripts/make_models.py): greedy tokens equal transformers' `generate` alone and with 16 concurrent
mixed requests joining and leaving the batch; through the server's /generate, /generate_stream and /v1/completions
(the openai client); what it does not do fails in one line."""
import json

import pytest

torch = pytest.importorskip("torch")

from engine.config import EngineConfig  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.seq2seq.engine import Seq2SeqEngine, is_seq2seq  # noqa: E402
from fakes import test_model_path  # noqa: E402

TEXT = ("The quick brown fox jumps over the lazy dog and then runs far away into the woods. "
        "def add(a, b):\n    return a + b\n\nprint(add(2, 3)) Hello world, said the compiler.")


@pytest.fixture(scope="module")
def reference():
    """(prompt ids, max_new_tokens) -> transformers' greedy tokens."""
    from transformers import AutoModelForSeq2SeqLM
    model = AutoModelForSeq2SeqLM.from_pretrained(test_model_path("tiny-flan-t5"), dtype=torch.float32).eval()

    def greedy(ids, max_new_tokens):
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
        return out[0, 1:].tolist()  # without the decoder start token
    return greedy


@pytest.fixture(scope="module")
def engine():
    config = EngineConfig(model_id=str(test_model_path("tiny-flan-t5")), device="cpu", dtype="float32",
                          max_batch_prefill_tokens=40)  # requests join over several steps, while others decode
    with Seq2SeqEngine(config) as engine:
        yield engine


def token_ids(outputs):
    return [[t.id for t in out.tokens] for out in outputs]


def test_greedy_tokens_equal_transformers_alone_and_16_concurrent(engine, reference):
    ids = engine.tokenizer.encode(TEXT)
    alone = engine.generate([ids[:24]], [SamplingParams(max_new_tokens=12)])
    assert token_ids(alone) == [reference(ids[:24], 12)]
    assert alone[0].text == engine.tokenizer.decode(reference(ids[:24], 12), skip_special_tokens=True)
    prompts = [ids[(3 * i) % 20:(3 * i) % 20 + 1 + (7 * i) % 30] for i in range(16)]
    new_tokens = [2 + i % 6 for i in range(16)]
    outputs = engine.generate(prompts, [SamplingParams(max_new_tokens=n) for n in new_tokens])
    assert token_ids(outputs) == [reference(p, n) for p, n in zip(prompts, new_tokens)]
    assert all(out.finish_reason == "length" and out.num_prompt_tokens == len(p) for out, p in zip(outputs, prompts))
    assert not engine.has_unfinished_requests() and engine.stats().num_running == 0
    # the sampler's per-thread buffers stay usable by a decoder-only engine stepping in this thread afterwards
    from types import SimpleNamespace

    from engine.sampler import sample
    row = SimpleNamespace(params=SamplingParams(), token_ids=[1], num_prompt_tokens=1, seed=None, generator=None)
    assert len(sample(torch.randn(2, 8), [row, row]).token_ids) == 2


def test_abort_and_hostile_requests(engine):
    ids = engine.tokenizer.encode(TEXT)[:10]
    engine.add_request("a", ids, SamplingParams(max_new_tokens=50))
    engine.add_request("b", ids, SamplingParams(max_new_tokens=3))
    first = engine.step()
    assert {out.request_id for out in first} == {"a", "b"}
    engine.abort("a")
    seen = []
    while engine.has_unfinished_requests():
        seen += engine.step()
    finals = {out.request_id: out for out in first + seen if out.finished}
    assert finals["a"].finish_reason == "aborted" and finals["b"].finish_reason == "length"
    from engine.structured.spec import GrammarSpec
    for bad, message in [(([], SamplingParams()), "the prompt is empty"),
                         (([5] * 600, SamplingParams()), "more than max_input_tokens=512"),
                         (([10**6], SamplingParams()), r"prompt token ids must lie in \[0, "),
                         ((ids, SamplingParams(max_new_tokens=0)), "max_new_tokens must be >= 1"),
                         ((ids, SamplingParams(grammar=GrammarSpec("regex", "[0-9]+"))), "takes no grammars")]:
        with pytest.raises(ValueError, match=message):
            engine.add_request("x", *bad)
    assert not engine.has_unfinished_requests()


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(engine, reference, monkeypatch):
    ids = engine.tokenizer.encode(TEXT)[:12]
    engine.add_request("doomed", ids, SamplingParams(max_new_tokens=4))
    with monkeypatch.context() as patch:
        patch.setattr(engine.batch, "next_logits", lambda: (_ for _ in ()).throw(RuntimeError("CUDA out of memory")))
        [failed] = engine.step()
    assert failed.finished and failed.error == "model step failed: RuntimeError: CUDA out of memory"
    assert not engine.has_unfinished_requests()
    assert token_ids(engine.generate([ids], [SamplingParams(max_new_tokens=4)])) == [reference(ids, 4)]


def test_options_it_lacks_fail_in_one_line():
    from engine.launcher import _seq2seq_engine
    model = str(test_model_path("tiny-flan-t5"))
    assert is_seq2seq(model) and _seq2seq_engine(EngineConfig(model_id=str(test_model_path("tiny-llama"))), None) \
        is None
    with pytest.raises(ValueError, match="without --num-shard > 1, --quantize") as error:
        _seq2seq_engine(EngineConfig(model_id=model, device="cpu", num_shard=2, quantize="fp8"), None)
    assert "\n" not in str(error.value)


def test_both_routes_give_transformers_tokens(engine, reference):
    """Last in the module: the server's AsyncEngine closes the module's engine."""
    from openai import OpenAI
    from starlette.testclient import TestClient

    from engine.async_engine import AsyncEngine
    from engine.server.app import build_app

    prompt = TEXT[:60]
    expected = reference(engine.tokenizer.encode(prompt), 8)
    text = engine.tokenizer.decode(expected, skip_special_tokens=True)
    served = AsyncEngine(engine).start()
    try:
        with TestClient(build_app(served, EngineConfig(model_id=engine.config.model_id))) as client:
            tgi = client.post("/generate", json={"inputs": prompt, "parameters": {"max_new_tokens": 8,
                                                                                   "details": True}}).json()
            assert [t["id"] for t in tgi["details"]["tokens"]] == expected and tgi["generated_text"] == text
            stream = client.post("/generate_stream", json={"inputs": prompt, "parameters": {"max_new_tokens": 8}})
            assert stream.status_code == 200 and f'"generated_text":{json.dumps(text)}' in stream.text
            completion = OpenAI(base_url="http://testserver/v1", api_key="none", http_client=client).completions \
                .create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
            assert completion.choices[0].text == text
            assert completion.usage.prompt_tokens == len(engine.tokenizer.encode(prompt))
            info = client.get("/info").json()
            assert info["model_impl"] == "transformers"
            assert info["attention_backend"] == "transformers (encoder-decoder)"
            refused = client.post("/generate", json={"inputs": prompt, "parameters": {
                "max_new_tokens": 4, "grammar": {"type": "regex", "value": "[0-9]+"}}})
            assert refused.status_code == 422 and refused.json()["error_type"] == "validation"
            assert "encoder-decoder model, which takes no grammars" in refused.json()["error"]
    finally:
        served.close()


@pytest.mark.gpu
def test_gpu_greedy_tokens_equal_transformers(model_path):
    from transformers import AutoModelForSeq2SeqLM

    path = model_path("tiny-flan-t5")
    model = AutoModelForSeq2SeqLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    config = EngineConfig(model_id=str(path), device="cuda", dtype="float32", max_batch_prefill_tokens=40)
    with Seq2SeqEngine(config) as engine:
        ids = engine.tokenizer.encode(TEXT)
        prompts = [ids[(3 * i) % 20:(3 * i) % 20 + 1 + (7 * i) % 30] for i in range(16)]
        outputs = engine.generate(prompts, [SamplingParams(max_new_tokens=6) for _ in prompts])
    with torch.no_grad():
        expected = [model.generate(torch.tensor([p], device="cuda"), max_new_tokens=6, do_sample=False)[0, 1:].tolist()
                    for p in prompts]
    assert token_ids(outputs) == expected
