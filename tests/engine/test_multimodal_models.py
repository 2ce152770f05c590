"""Vision-language models on the transformers backend (engine/multimodal) against transformers itself (fp32, CPU):
tiny random LLaVA, LLaVA-NeXT, Idefics3, Idefics2, VipLLaVA, LightOnOCR (Pixtral vision), Aya Vision and DeepSeek-VL
(SigLIP + an aligner on Llama), and where torchvision imports Mistral 3, SmolVLM and Command A Vision, with their
real processors (scripts/tiny_vlms.py). Requests with 1 and 2 images and a
text-only one in one batch, under a prefill budget small enough that chunk boundaries fall inside images, give
transformers' greedy tokens for the same processor output; the encoder runs once per request; the prefix cache
shares the blocks of a repeated image and not those of a different one."""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("PIL")

from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.multimodal.image_source import ImageLimits, decode  # noqa: E402
from engine.multimodal.processor import VisionProcessor  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from fakes import test_model_path  # noqa: E402
from images import png  # noqa: E402
from make_models import TORCHVISION_VLMS, torchvision_works  # noqa: E402

VLMS = ["tiny-llava", "tiny-llava-next", "tiny-idefics3", "tiny-idefics2", "tiny-vipllava", "tiny-lightonocr",
        "tiny-aya-vision", "tiny-deepseek-vl", "tiny-mistral3", "tiny-smolvlm", "tiny-command-a-vision"]
NEW_TOKENS = 6
NO_TORCHVISION = "torchvision does not import beside this torch"   # tests/support/skip_guard.py ALLOWED


def engine_for(name, **config):
    config = {"cpu_kv_cache_bytes": 8 * 2**20, "max_batch_prefill_tokens": 7, **config}
    return LLMEngine(EngineConfig(model_id=str(test_model_path(name)), device="cpu", dtype="float32", **config))


def hf_greedy(model, ids, images, max_new_tokens):
    inputs = dict(images.encoder_inputs) if images is not None else {}
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             **inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(ids):].tolist()


def token_ids(outputs):
    return [[t.id for t in out.tokens] for out in outputs]


@pytest.mark.parametrize("name", VLMS)
def test_greedy_tokens_equal_transformers_with_one_and_two_images(name):
    from transformers import AutoModelForImageTextToText

    if name in TORCHVISION_VLMS and not torchvision_works():
        pytest.skip(NO_TORCHVISION)
    path = test_model_path(name)
    with engine_for(name) as engine:
        assert engine.model_config.impl == "transformers" and engine.model_config.image_token_id is not None
        vision = VisionProcessor.from_pretrained(path, engine.model_config.image_token_id, ImageLimits(), 4)
        pictures = [decode(png(seed, 40 + 10 * seed, 30 + 5 * seed), ImageLimits()) for seed in range(2)]
        one = vision.process(f"Describe {vision.placeholder} please", pictures[:1])
        two = vision.process(f"First {vision.placeholder} then {vision.placeholder}: compare", pictures)
        text = (engine.tokenizer.encode("just some text, no image at all"), None)
        requests = [one, two, text]  # one's prefill chunk ends inside its image (budget of 7 tokens)
        outputs = engine.generate([ids for ids, _ in requests], SamplingParams(max_new_tokens=NEW_TOKENS),
                                  [images for _, images in requests])
        assert engine.runner._rank0.encoder_cache.num_encoded == 2  # once per request with images
    reference = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    for (ids, images), got in zip(requests, token_ids(outputs)):
        assert got == hf_greedy(reference, ids, images, NEW_TOKENS), f"{name}: prompt of {len(ids)} tokens"


def test_prefix_cache_shares_a_repeated_image_not_a_different_one():
    path = test_model_path("tiny-llava")
    with engine_for("tiny-llava", max_batch_prefill_tokens=64) as engine:
        vision = VisionProcessor.from_pretrained(path, engine.model_config.image_token_id, ImageLimits(), 4)

        def run(seed):
            ids, images = vision.process(f"Look: {vision.placeholder} and say", [decode(png(seed), ImageLimits())])
            return engine.generate([ids], SamplingParams(max_new_tokens=3), [images])[0], ids, images

        first, ids, _ = run(1)
        assert first.num_cached_tokens == 0
        again, ids_again, _ = run(1)
        assert ids_again == ids and again.num_cached_tokens > 0
        assert token_ids([again]) == token_ids([first])
        other, ids_other, _ = run(2)
        assert ids_other == ids  # the same tokens: only the image's hash tells the blocks apart
        assert other.num_cached_tokens < 16  # the block holding the image's first token is not shared
        encoder = engine.runner._rank0.encoder_cache
        calls, encoded = encoder.num_calls, encoder.num_encoded
        both = [vision.process(f"Two: {vision.placeholder}", [decode(png(seed), ImageLimits())]) for seed in (5, 6)]
        together = engine.generate([ids for ids, _ in both], SamplingParams(max_new_tokens=3),
                                   [images for _, images in both])
        assert (encoder.num_calls, encoder.num_encoded) == (calls + 1, encoded + 2)  # [1, 3, 32, 32] each: batched
        alone = [engine.generate([ids], SamplingParams(max_new_tokens=3), [images])[0] for ids, images in both]
        assert token_ids(together) == token_ids(alone)


def test_text_only_model_refuses_images():
    from engine.multimodal.prompt import MultiModalPrompt

    with engine_for("tiny-llama") as engine:
        images = MultiModalPrompt({}, [1], [(1, 7)], 1)
        with pytest.raises(ValueError, match="text-only model"):
            engine.add_request("r", [1, 2, 3], SamplingParams(max_new_tokens=2), images)
