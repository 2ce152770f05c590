"""Vision-language models on the transformers backend (engine/multimodal) against transformers itself (fp32, CPU):
tiny random LLaVA, LLaVA-NeXT, Idefics3, Idefics2, VipLLaVA, LightOnOCR (Pixtral vision), Aya Vision, DeepSeek-VL
(SigLIP + an aligner on Llama) and Qwen2-VL, Qwen2.5-VL, Qwen3-VL (M-RoPE; Qwen3-VL's DeepStack), and where torchvision
imports Mistral 3, SmolVLM and Command A Vision, with their real processors (scripts/tiny_vlms.py). Requests with 1
and 2 images and a
text-only one in one batch, under a prefill budget small enough that chunk boundaries fall inside images, give
transformers' greedy tokens for the same processor output; the encoder runs once per request; the prefix cache
shares the blocks of a repeated image and not those of a different one. Gemma 3, whose image tokens attend to each
other both ways, is computed one whole image per prefill chunk and matches transformers' logprobs too. Under async
scheduling, image prompt chunks and M-RoPE decodes ride in the steps launched ahead with the synchronous tokens."""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("PIL")

from engine.config import EngineConfig  # noqa: E402
from engine.deferred_outputs import expand  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.multimodal.image_source import ImageLimits, decode  # noqa: E402
from engine.multimodal.processor import VisionProcessor  # noqa: E402
from engine.multimodal.prompt import MultiModalPrompt  # noqa: E402
from engine.outputs import RequestOutput  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from fakes import test_model_path  # noqa: E402
from images import png  # noqa: E402
from make_models import TORCHVISION_VLMS, torchvision_works  # noqa: E402

VLMS = ["tiny-llava", "tiny-llava-next", "tiny-idefics3", "tiny-idefics2", "tiny-vipllava", "tiny-lightonocr",
        "tiny-aya-vision", "tiny-deepseek-vl", "tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-mistral3",
        "tiny-smolvlm", "tiny-command-a-vision"]
NEW_TOKENS = 6
NO_TORCHVISION = "torchvision does not import beside this torch"   # tests/support/skip_guard.py ALLOWED


def engine_for(name, **config):
    config = {"cpu_kv_cache_bytes": 8 * 2**20, "max_batch_prefill_tokens": 7, **config}
    return LLMEngine(EngineConfig(model_id=str(test_model_path(name)), device="cpu", dtype="float32", **config))


def hf_greedy(model, ids, images, max_new_tokens):
    inputs = dict(images.encoder_inputs) if images is not None else {}
    if "image_grid_thw" in inputs:  # M-RoPE: transformers places the image grids by the token types
        inputs["mm_token_type_ids"] = (torch.tensor([ids]) == model.config.image_token_id).long()
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


@pytest.mark.parametrize("name", ["tiny-llava", "tiny-qwen2-vl", "tiny-qwen3-vl"])
def test_steps_ahead_with_images_give_the_synchronous_tokens(name):
    """Async scheduling (engine/async_scheduling.py): image prompt chunks ride in the steps launched ahead, the
    encoder run before the launch once per request, and the decodes after M-RoPE images keep their offset. The
    tokens and logprobs are the synchronous engine's, and every step that can goes ahead."""
    path = test_model_path(name)
    results = {}
    for mode in ("off", "on"):
        with engine_for(name, async_scheduling=mode) as engine:
            vision = VisionProcessor.from_pretrained(path, engine.model_config.image_token_id, ImageLimits(), 4)
            pictures = [decode(png(seed, 40 + 10 * seed, 30 + 5 * seed), ImageLimits()) for seed in range(2)]
            requests = [(engine.tokenizer.encode("some text first, no image"), None),
                        vision.process(f"Describe {vision.placeholder} please", pictures[:1]),
                        vision.process(f"First {vision.placeholder} then {vision.placeholder}: compare", pictures)]
            params = SamplingParams(max_new_tokens=NEW_TOKENS + 4, logprobs=True, ignore_eos=True)
            tokens, steps = {i: [] for i in range(len(requests))}, 0
            engine.add_request("0", *requests[0][:1], params)
            while engine.has_unfinished_requests():
                if steps == 2:  # the image requests arrive while the first one runs
                    for i, (ids, images) in enumerate(requests[1:], start=1):
                        engine.add_request(str(i), ids, params, images)
                for out in expand(engine.step()):
                    tokens[int(out.request_id)] += [(t.id, round(t.logprob, 4)) for t in out.tokens]
                steps += 1
                assert steps < 200
            results[mode] = tokens
            assert engine.runner._rank0.encoder_cache.num_encoded == 2     # once per request with images
            if mode == "on":
                # all but the first prompt's two chunks (nothing in flight: the first samples nothing) and the last
                # step (it resolves the last token, nothing to launch)
                assert engine.stats().num_steps_ahead_total == steps - 3
            assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert results["on"] == results["off"]
    assert all(len(got) == NEW_TOKENS + 4 for got in results["off"].values())


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
    with engine_for("tiny-llama") as engine:
        images = MultiModalPrompt({}, [1], [(1, 7)], 1)
        with pytest.raises(ValueError, match="text-only: it takes no images"):
            engine.add_request("r", [1, 2, 3], SamplingParams(max_new_tokens=2), images)


def test_gemma3_served_natively_names_the_flag_that_serves_its_images():
    """`--model-impl auto` serves a multimodal Gemma 3 checkpoint text-only on the native class: the refusal of an
    image says how to get the vision tower, in the engine (offline batch) and in the server's 422."""
    from starlette.testclient import TestClient

    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from engine.server.app import build_app

    config = EngineConfig(model_id=str(test_model_path("tiny-gemma3-vision")), device="cpu", dtype="float32",
                          cpu_kv_cache_bytes=8 * 2**20)
    engine = AsyncEngine(LLMEngine(config)).start()
    try:
        assert engine.engine.model_config.impl == "native"
        with pytest.raises(ValueError, match="served text-only.*--model-impl transformers"):
            engine.engine.add_request("r", [1, 2, 3], SamplingParams(max_new_tokens=2),
                                      MultiModalPrompt({}, [1], [(1, 7)], 1))
        with TestClient(build_app(engine, config)) as client:
            body = {"max_tokens": 2, "messages": [{"role": "user", "content": [
                {"type": "text", "text": "what is this?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}
            answer = client.post("/v1/chat/completions", json=body)
            assert answer.status_code == 422 and answer.json()["error_type"] == "validation"
            assert "--model-impl transformers" in answer.json()["error"]
    finally:
        engine.close()


BIDIRECTIONAL_VLMS = ["tiny-gemma3-vision"]  # an image's tokens attend to each other both ways


@pytest.mark.parametrize("name", BIDIRECTIONAL_VLMS)
def test_images_attending_both_ways_give_transformers_tokens(name):
    """Gemma 3 (--model-impl transformers): each image is computed in one prefill chunk, its tokens seeing the whole
    image as transformers' mask from token_type_ids lets them (on CPU's default backend, cpu_paged: the image chunks
    take its SDPA path); a budget of 7 tokens would have cut the first request's image. Prompt logprobs are
    compared too: greedy tokens alone hardly depend on the image rows."""
    from transformers import AutoModelForImageTextToText

    path = test_model_path(name)
    with engine_for(name, model_impl="transformers", block_size=4) as engine:
        assert engine.model_config.bidirectional_images
        vision = VisionProcessor.from_pretrained(path, engine.model_config.image_token_id, ImageLimits(), 4)
        pictures = [decode(png(seed, 40 + 10 * seed, 30 + 5 * seed), ImageLimits()) for seed in range(2)]
        one = vision.process(f"See {vision.placeholder}", pictures[:1])
        two = vision.process(f"First {vision.placeholder} then {vision.placeholder}: compare", pictures)
        runs = one[1].attending_both_ways(7).runs
        assert any(start < cut < end for cut in range(7, len(one[0]), 7) for start, end in runs)
        text = (engine.tokenizer.encode("just some text, no image at all"), None)
        requests = [one, two, text]
        params = SamplingParams(max_new_tokens=NEW_TOKENS, prefill_logprobs=True)  # the image rows' logprobs too
        for i, (ids, images) in enumerate(requests):
            engine.add_request(str(i), ids, params, images)
        outputs = [RequestOutput(str(i), [], "", prefill_tokens=[]) for i in range(len(requests))]
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs[int(out.request_id)].tokens += out.tokens
                outputs[int(out.request_id)].prefill_tokens += out.prefill_tokens or []
        # again: its first 8 tokens come from the prefix cache, and its chunk starts inside the image
        again = engine.generate([one[0]], SamplingParams(max_new_tokens=NEW_TOKENS), [one[1]])
        assert again[0].num_cached_tokens == 8 and runs == [(6, 10)]
        assert token_ids(again) == token_ids(outputs[:1])
        too_long = MultiModalPrompt({}, list(range(1, 9)), [(1, 1)], 1)  # an image of 8 tokens, chunks of 7
        with pytest.raises(ValueError, match=r"an image of 8 tokens .*--max-batch-prefill-tokens"):
            engine.add_request("too-long", list(range(12)), params, too_long)
    reference = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    image_id = reference.config.image_token_id
    for (ids, images), output in zip(requests, outputs):
        kinds = {"token_type_ids": (torch.tensor([ids]) == image_id).long()} if images is not None else {}
        with torch.no_grad():
            logits = reference(input_ids=torch.tensor([ids]), **(dict(images.encoder_inputs) if images else {}),
                               **kinds).logits[0, :-1]
        prompt_logprobs = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
        assert [t.logprob for t in output.prefill_tokens[1:]] == pytest.approx(prompt_logprobs, abs=1e-4)
        with torch.no_grad():
            out = reference.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)).long(),
                                     **(dict(images.encoder_inputs) if images else {}), **kinds,
                                     max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                                     return_dict_in_generate=True)
        expected = out.sequences[0, len(ids):].tolist()
        assert [t.id for t in output.tokens] == expected, f"{name}: prompt of {len(ids)} tokens"
        logprobs = [torch.log_softmax(step[0], -1)[token].item() for step, token in zip(out.logits, expected)]
        assert [t.logprob for t in output.tokens] == pytest.approx(logprobs, abs=1e-4)


def test_prefix_cache_hit_past_an_image_keeps_the_mrope_positions():
    """A repeated Qwen2-VL prompt resumes after its cached image blocks: positions there are flat + the prompt's
    delta, and the tokens are the first run's."""
    path = test_model_path("tiny-qwen2-vl")
    with engine_for("tiny-qwen2-vl", max_batch_prefill_tokens=64) as engine:
        vision = VisionProcessor.from_pretrained(path, engine.model_config.image_token_id, ImageLimits(), 4)

        def run():
            text = f"Look: {vision.placeholder} and then tell me, in a few words, what you see in it"
            ids, images = vision.process(text, [decode(png(3, 64, 48), ImageLimits())])
            return engine.generate([ids], SamplingParams(max_new_tokens=NEW_TOKENS), [images])[0], images

        first, images = run()
        again, _ = run()
        assert images.rope_delta < 0 and again.num_cached_tokens > images.end  # resumes past the image
        assert token_ids([again]) == token_ids([first])
