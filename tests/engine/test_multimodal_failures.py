"""A vision encoder that raises inside a step fails only the requests whose images it failed on
(engine/multimodal/encoder_cache.py, LLMEngine._encode_images).

A real tiny LightOnOCR (Pixtral's vision tower) takes a request whose second image is 1x1: its processor accepts
it, and the tower's 2x2 patch merge raises on the single patch, in the same batched encoder call as a good request.
Over HTTP that request gets TGI's 424 and the server keeps serving. A real tiny LLaVA-NeXT is given encoder inputs
it cannot take (a zero image size, batched with a good image; four channels, as an unconverted CMYK image would
give). The bad requests end with the encoder's error; the good image and a text-only request in the same step
still give transformers' greedy tokens; nothing of the failed requests stays in the KV cache; the engine keeps
serving, also when the failed request's images are encoded for a step launched ahead (async scheduling). The unit
test drives the retry logic with a scripted encoder."""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("PIL")

from engine.batch import SeqSpan  # noqa: E402
from engine.deferred_outputs import expand  # noqa: E402
from engine.multimodal.encoder_cache import EncoderCache  # noqa: E402
from engine.multimodal.image_source import ImageLimits, decode  # noqa: E402
from engine.multimodal.processor import VisionProcessor  # noqa: E402
from engine.multimodal.prompt import MultiModalPrompt  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from fakes import test_model_path  # noqa: E402
from images import data_url, png  # noqa: E402
from test_multimodal_models import engine_for, hf_greedy, token_ids  # noqa: E402

NEW_TOKENS = 5


def tampered(prompt, **inputs):
    return MultiModalPrompt({**prompt.encoder_inputs, **inputs}, prompt.positions, prompt.keys, prompt.num_images)


def test_an_encoder_failure_fails_only_its_request():
    from transformers import AutoModelForImageTextToText

    path = test_model_path("tiny-llava-next")
    with engine_for("tiny-llava-next", max_batch_prefill_tokens=512) as engine:
        vision = VisionProcessor.from_pretrained(path, engine.model_config.image_token_id, ImageLimits(), 4)
        good = vision.process(f"Describe {vision.placeholder} please", [decode(png(1, 40, 30), ImageLimits())])
        ids, images = vision.process(f"What is {vision.placeholder} here", [decode(png(2, 30, 40), ImageLimits())])
        zero_size = (ids, tampered(images, image_sizes=torch.tensor([[0, 0]])))  # same shapes as good: batched
        pixels = images.encoder_inputs["pixel_values"]
        four_channels = (ids, tampered(images, pixel_values=torch.cat([pixels, pixels[:, :, :1]], dim=2)))
        text = (engine.tokenizer.encode("only words in this one"), None)
        requests = [good, zero_size, text, four_channels]
        outputs = engine.generate([ids for ids, _ in requests], SamplingParams(max_new_tokens=NEW_TOKENS),
                                  [images for _, images in requests])
        for failed in (outputs[1], outputs[3]):
            assert failed.finished and failed.tokens == [] and failed.num_generated_tokens == 0
            assert failed.error.startswith("the vision encoder failed on this request's images"), failed.error
        assert "ZeroDivisionError" in outputs[1].error
        assert outputs[0].error is None and outputs[2].error is None
        encoder = engine.runner._rank0.encoder_cache
        assert encoder.num_encoded == 1 and encoder.features == {}
        manager = engine.block_manager
        assert manager.num_free_blocks == manager.num_blocks  # the failed requests' blocks went back...
        again = engine.generate([good[0], zero_size[0]], SamplingParams(max_new_tokens=NEW_TOKENS),
                                [good[1], images])  # ...and a later step with the untampered image runs
        assert again[1].error is None and again[1].num_cached_tokens == 0  # nothing of the failed one was cached
        assert token_ids(again[:1]) == token_ids(outputs[:1])
    reference = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    for (ids, images), got in zip([good, text, (zero_size[0], images)], token_ids([outputs[0], outputs[2], again[1]])):
        assert got == hf_greedy(reference, ids, images, NEW_TOKENS)


def run_arriving(engine, first, arriving, params):
    """`first` runs alone for a step (its token then in flight with async scheduling), then `arriving` comes; each
    request's (token ids, error), by its index."""
    results = {i: ([], None) for i in range(1 + len(arriving))}

    def collect(outputs):
        for out in expand(outputs):
            tokens, error = results[int(out.request_id)]
            results[int(out.request_id)] = (tokens + [t.id for t in out.tokens], error or out.error)

    engine.add_request("0", first[0], params[0], first[1])
    collect(engine.step())
    for i, (ids, images) in enumerate(arriving, start=1):
        engine.add_request(str(i), ids, params[i], images)
    while engine.has_unfinished_requests():
        collect(engine.step())
    return results


def test_an_encoder_failure_in_a_step_launched_ahead_fails_only_its_request():
    """Async scheduling encodes the images of a step launched ahead before its launch (LLMEngine._step_ahead): the
    request whose images fail ends with the encoder's error, and the others are the synchronous engine's, both when
    others go on in that step and when the failed request was all of it (nothing is launched then)."""
    path = test_model_path("tiny-llava-next")
    runs = {}
    for mode in ("off", "on"):
        with engine_for("tiny-llava-next", max_batch_prefill_tokens=512, async_scheduling=mode) as engine:
            vision = VisionProcessor.from_pretrained(path, engine.model_config.image_token_id, ImageLimits(), 4)
            good = vision.process(f"Describe {vision.placeholder} please", [decode(png(1, 40, 30), ImageLimits())])
            ids, images = vision.process(f"What is {vision.placeholder} here", [decode(png(2, 30, 40), ImageLimits())])
            bad = (ids, tampered(images, image_sizes=torch.tensor([[0, 0]])))
            text = (engine.tokenizer.encode("only words in this one"), None)
            many = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
            one = SamplingParams(max_new_tokens=1, ignore_eos=True)
            together = run_arriving(engine, text, [good, bad], [many] * 3)  # the text request decodes on
            ahead = engine.stats().num_steps_ahead_total
            alone = run_arriving(engine, text, [bad], [one, many])  # its one token ends the first: N+1 is all bad
            assert engine.stats().num_steps_ahead_total == ahead    # so no step launched: not an empty one
            runs[mode] = (together, alone, run_arriving(engine, text, [good], [one, many]))  # the engine serves on
            if mode == "on":
                assert engine.stats().num_steps_ahead_total > NEW_TOKENS
            assert engine.runner._rank0.encoder_cache.features == {}
            assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    (together, alone, after), off = runs["on"], runs["off"]
    for results in (together, alone):
        tokens, error = results[len(results) - 1]
        assert tokens == [] and error.startswith("the vision encoder failed on this request's images"), error
    assert [len(tokens) for tokens, _ in together.values()] == [NEW_TOKENS, NEW_TOKENS, 0]
    assert (together, alone, after) == off


def test_a_tiny_second_image_fails_its_request_alone():
    from transformers import AutoModelForImageTextToText

    path = test_model_path("tiny-lightonocr")
    with engine_for("tiny-lightonocr", max_batch_prefill_tokens=512) as engine:
        vision = VisionProcessor.from_pretrained(path, engine.model_config.image_token_id, ImageLimits(), 4)
        pictures = [decode(png(seed, 40, 30), ImageLimits()) for seed in (1, 2)]
        good = vision.process(f"Read {vision.placeholder} now", pictures[:1])
        tiny = vision.process(f"Read {vision.placeholder} and {vision.placeholder}",
                              [pictures[1], decode(png(3, 1, 1), ImageLimits())])
        assert tiny[1].encoder_inputs["pixel_values"].shape[1:] == good[1].encoder_inputs["pixel_values"].shape[1:]
        text = (engine.tokenizer.encode("a request without images"), None)
        requests = [good, tiny, text]
        outputs = engine.generate([ids for ids, _ in requests], SamplingParams(max_new_tokens=NEW_TOKENS),
                                  [images for _, images in requests])
        assert outputs[1].error.startswith("the vision encoder failed on this request's images: RuntimeError")
        assert outputs[0].error is None and outputs[2].error is None
        assert engine.runner._rank0.encoder_cache.num_encoded == 1  # the shared call failed; the good one alone ran
    reference = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    for (ids, images), got in zip([good, text], token_ids([outputs[0], outputs[2]])):
        assert got == hf_greedy(reference, ids, images, NEW_TOKENS)


def test_over_http_the_failed_request_gets_a_424_and_the_server_keeps_serving():
    from starlette.testclient import TestClient

    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.server.app import build_app

    config = EngineConfig(model_id=str(test_model_path("tiny-lightonocr")), device="cpu", dtype="float32",
                          cpu_kv_cache_bytes=4 * 2**20)
    engine = AsyncEngine(LLMEngine(config)).start()

    def chat(client, *images):
        content = [{"type": "text", "text": "Read"}] + [{"type": "image_url", "image_url": {"url": data_url(image)}}
                                                         for image in images]
        return client.post("/v1/chat/completions", json={"max_tokens": 3,
                                                         "messages": [{"role": "user", "content": content}]})
    try:
        with TestClient(build_app(engine, config)) as client:
            answer = chat(client, png(1), png(2, 1, 1))
            assert answer.status_code == 424, answer.text
            assert answer.json()["error_type"] == "generation" and "vision encoder failed" in answer.json()["error"]
            assert chat(client, png(1)).status_code == 200
            assert client.get("/health").status_code == 200
    finally:
        engine.close()


def span(seq_id, rows, width):
    inputs = {"pixel_values": torch.full((1, width), float(seq_id))}
    return SeqSpan(seq_id, [0] * rows, 0, [0], "last", images=MultiModalPrompt(inputs, list(range(rows)),
                                                                                   [(0, seq_id)], 1))


def test_a_shared_encoder_call_that_fails_is_retried_per_request():
    calls = []

    def encode(inputs):  # two rows of output per request; request 3's input makes it raise
        values = inputs["pixel_values"][:, 0]
        calls.append(values.tolist())
        if (values == 3).any():
            raise RuntimeError("CUDA out of memory (scripted)")
        return values.repeat_interleave(2)[:, None].expand(-1, 4)

    cache = EncoderCache(encode)
    spans = [span(1, 2, 8), span(3, 2, 8), span(5, 2, 8), span(7, 2, 6)]
    failed = cache.encode(spans)
    assert list(failed) == [3] and "RuntimeError: CUDA out of memory (scripted)" in failed[3]
    assert calls == [[1.0, 3.0, 5.0], [1.0], [3.0], [5.0], [7.0]]  # the group, then each alone; 7's own shapes
    assert sorted(cache.features) == [1, 5, 7] and (cache.num_calls, cache.num_encoded) == (3, 3)
    assert cache.encode([spans[0], spans[2]]) == {} and len(calls) == 5  # encoded ones are not encoded again
    rows, vectors = cache.embeddings([spans[0], spans[2]])
    assert rows.tolist() == [0, 1, 2, 3] and vectors[:, 0].tolist() == [1, 1, 5, 5]
    with pytest.raises(ValueError, match="failed on this request's images"):
        cache.embeddings(spans[1:2])  # a caller that did not drop the failed request gets its error


def test_a_processor_that_needs_a_missing_package_is_refused_in_one_line(monkeypatch):
    """Mistral 3's PixtralProcessor without torchvision, SmolVLM's without num2words: transformers raises a
    multi-line ImportError at load; the server refuses to start with one line naming the package."""
    import transformers

    message = ("\nPixtralProcessor requires the Torchvision library but it was not found in your environment. "
               "Check out the instructions on the\ninstallation page: https://pytorch.org/get-started/locally/\n")

    def missing(*args, **kwargs):
        raise ImportError(message)

    monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", missing)
    with pytest.raises(ValueError) as refused:
        VisionProcessor.from_pretrained(test_model_path("tiny-llava"), 1, ImageLimits(), 4)
    assert "\n" not in str(refused.value)
    assert "processor cannot load: PixtralProcessor requires the Torchvision library" in str(refused.value)
