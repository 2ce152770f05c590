"""The transformers backend (engine/models/transformers_backend.py) against transformers itself (fp32, CPU), on
tiny random checkpoints of architectures we have no native class for (scripts/make_models.py): greedy tokens
through LLMEngine at batch 1 and with 16 concurrent mixed requests equal transformers' `generate`; Llama and
Qwen3 through the backend equal our native classes; prefix cache, speculation, grammars and /info on top; the
models and options it cannot serve fail in one line."""
import re

import pytest

torch = pytest.importorskip("torch")

from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.model_config import ModelConfig  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from fakes import test_model_path  # noqa: E402
from hf_reference import hf_greedy  # noqa: E402

# architectures without a native class (Llama 4 text, gpt-oss with attention sinks and sliding windows, ...)
BACKEND_MODELS = ["tiny-gpt-neox", "tiny-opt", "tiny-glm4", "tiny-llama4", "tiny-gpt-oss", "tiny-gemma", "tiny-phi",
                  "tiny-granite", "tiny-olmo", "tiny-cohere", "tiny-gptj", "tiny-exaone4"]
TEXT = ("The quick brown fox jumps over the lazy dog and then runs far away into the woods. "
        "def add(a, b):\n    return a + b\n\nprint(add(2, 3)) Hello world, said the compiler.")


def engine_for(name, **config):
    # small prefill budget: long prompts are chunked and share steps with other requests' decodes
    config = {"cpu_kv_cache_bytes": 8 * 2**20, "max_batch_prefill_tokens": 40, **config}
    return LLMEngine(EngineConfig(model_id=str(test_model_path(name)), device="cpu", dtype="float32", **config))


def mixed_requests(tokenizer, count=16):
    """Prompts of 1 to 29 tokens, 2 to 7 new tokens each: prefills, chunked prefills and decodes in one step."""
    ids = tokenizer.encode(TEXT)
    return [ids[(3 * i) % 20:(3 * i) % 20 + 1 + (7 * i) % 30] for i in range(count)], [2 + i % 6 for i in range(count)]


def token_ids(outputs):
    return [[t.id for t in out.tokens] for out in outputs]


@pytest.mark.parametrize("name", BACKEND_MODELS)
def test_greedy_tokens_equal_transformers_alone_and_16_concurrent(name):
    from transformers import AutoModelForCausalLM
    reference = AutoModelForCausalLM.from_pretrained(test_model_path(name), dtype=torch.float32,
                                                     attn_implementation="eager").eval()
    with engine_for(name) as engine:
        assert engine.model_config.impl == "transformers"
        prompt = engine.tokenizer.encode(TEXT)[:24]
        alone = engine.generate([prompt], [SamplingParams(max_new_tokens=12)])
        assert token_ids(alone) == [hf_greedy(reference, prompt, 12)], name
        prompts, new_tokens = mixed_requests(engine.tokenizer)
        outputs = engine.generate(prompts, [SamplingParams(max_new_tokens=n) for n in new_tokens])
        for ids, n, got in zip(prompts, new_tokens, token_ids(outputs)):
            assert got == hf_greedy(reference, ids, n), f"{name}: prompt of {len(ids)} tokens"


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_backend_gives_the_native_classes_tokens(name):
    results = {}
    for impl in ("native", "transformers"):
        with engine_for(name, model_impl=impl) as engine:
            assert engine.model_config.impl == impl
            prompts, new_tokens = mixed_requests(engine.tokenizer)
            results[impl] = token_ids(engine.generate(prompts, [SamplingParams(max_new_tokens=n) for n in new_tokens]))
    assert results["transformers"] == results["native"]


@pytest.fixture(scope="module")
def sink_engine():
    """gpt-oss: attention sinks (our own path over the paged cache) and a sliding window of 8."""
    with engine_for("tiny-gpt-oss", speculate=2) as engine:
        yield engine


def test_prefix_cache_and_speculation_keep_the_tokens(sink_engine):
    from transformers import AutoModelForCausalLM
    reference = AutoModelForCausalLM.from_pretrained(test_model_path("tiny-gpt-oss"), dtype=torch.float32,
                                                     attn_implementation="eager").eval()
    prompt = (sink_engine.tokenizer.encode(TEXT) * 2)[:40]  # repeats: n-gram drafts get proposed
    first, second = (sink_engine.generate([prompt], [SamplingParams(max_new_tokens=20)])[0] for _ in range(2))
    expected = hf_greedy(reference, prompt, 20)
    assert token_ids([first]) == token_ids([second]) == [expected]
    assert second.num_cached_tokens >= 32  # the second request read two full blocks from the prefix cache


def test_server_reports_the_backend_and_grammars_constrain_it(sink_engine):
    from starlette.testclient import TestClient

    from engine.async_engine import AsyncEngine
    from engine.server.app import build_app

    config = EngineConfig(model_id=str(test_model_path("tiny-gpt-oss")), served_model_name="tiny")
    engine = AsyncEngine(sink_engine).start()  # closes the module's engine (closing twice is safe)
    try:
        with TestClient(build_app(engine, config)) as client:
            assert client.get("/info").json()["model_impl"] == "transformers"
            body = {"inputs": "count:", "parameters": {"max_new_tokens": 6,
                                                       "grammar": {"type": "regex", "value": "[0-9]{3}"}}}
            answer = client.post("/generate", json=body)
            assert answer.status_code == 200, answer.text
            assert re.fullmatch("[0-9]{3}", answer.json()["generated_text"])
    finally:
        engine.close()


@pytest.mark.parametrize("name", ["tiny-gpt-neo", "tiny-mpt"])
def test_models_whose_attention_bypasses_the_interface_are_refused(name):
    with pytest.raises(ValueError, match="bypasses transformers' attention interface") as error:
        ModelConfig.from_pretrained(test_model_path(name))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("name", ["tiny-falcon", "tiny-bloom"])
def test_falcon_and_bloom_run_natively_and_the_backend_refuses_them(name):
    """Their attention bypasses transformers' interface: auto picks our classes (engine/models/falcon.py, bloom.py)."""
    assert ModelConfig.from_pretrained(test_model_path(name)).impl == "native"
    with pytest.raises(ValueError, match="bypasses transformers' attention interface"):
        ModelConfig.from_pretrained(test_model_path(name), "transformers")


def test_image_text_models_are_judged_by_their_language_model():
    import transformers as T

    from engine.models.transformers_backend import unsupported_reason

    sizes = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=1, vocab_size=128)
    # DeepSeek-VL's top class declares no attention backend; its Llama language model goes through the interface
    assert not getattr(T.DeepseekVLForConditionalGeneration, "_supports_attention_backend", False)
    assert unsupported_reason(T.DeepseekVLConfig(text_config=T.LlamaConfig(**sizes), image_token_id=5)) is None
    # LLaVA declares one, but a Falcon language model under it bypasses the interface
    falcon = T.LlavaConfig(text_config=T.FalconConfig(**sizes), image_token_index=5)
    assert "FalconModel's attention bypasses" in unsupported_reason(falcon)


def write_config(folder, config):
    folder.mkdir()
    (folder / "config.json").write_text(config.to_json_string())
    return folder


def test_encoder_decoders_and_non_kv_caches_are_refused(tmp_path):
    from transformers import Qwen3NextConfig, T5Config
    t5 = T5Config(d_model=32, num_layers=1, num_heads=2, d_ff=64, vocab_size=128)
    t5.architectures = ["T5ForConditionalGeneration"]
    with pytest.raises(ValueError, match="encoder-decoder"):
        ModelConfig.from_pretrained(write_config(tmp_path / "t5", t5))
    hybrid = Qwen3NextConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                             layer_types=["linear_attention", "full_attention"], vocab_size=128)
    hybrid.architectures = ["Qwen3NextForCausalLM"]
    with pytest.raises(ValueError, match="linear_attention keep a cache that is not key/value"):
        ModelConfig.from_pretrained(write_config(tmp_path / "hybrid", hybrid))


def test_model_impl_choice():
    neox, llama = test_model_path("tiny-gpt-neox"), test_model_path("tiny-llama")
    assert ModelConfig.from_pretrained(llama).impl == "native"                      # auto: the native class
    assert ModelConfig.from_pretrained(neox).impl == "transformers"                 # auto: none, so transformers
    assert ModelConfig.from_pretrained(llama, "transformers").impl == "transformers"
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM.*is not supported"):
        ModelConfig.from_pretrained(neox, "native")
    with pytest.raises(ValueError, match="--model-impl 'hf' is not one of auto, native, transformers"):
        ModelConfig.from_pretrained(neox, "hf")


@pytest.mark.parametrize("option, message", [
    ({"num_shard": 2}, "no tensor parallelism yet: use --num-shard 1"),
    ({"lora_adapters": [("a", "/nowhere")]}, "takes no LoRA adapters yet"),
    ({"quantize": "fp8"}, "serves unquantized checkpoints only"),
])
def test_options_the_backend_lacks_fail_in_one_line(option, message):
    from engine.model_runner import ModelRunner
    config = EngineConfig(model_id=str(test_model_path("tiny-gpt-neox")), device="cpu", dtype="float32", **option)
    with pytest.raises(ValueError, match=message) as error:
        ModelRunner(config, ModelConfig.from_pretrained(config.model_id))
    assert "\n" not in str(error.value)


def test_launcher_flag_reaches_the_config():
    from engine.launcher import parse_args, to_config
    assert to_config(parse_args(["--model-id", "/m", "--model-impl", "transformers"], {}), "/m").model_impl \
        == "transformers"
    assert to_config(parse_args(["--model-id", "/m"], {}), "/m").model_impl == "auto"
    with pytest.raises(SystemExit):
        parse_args(["--model-id", "/m"], {"MODEL_IMPL": "vllm"})
