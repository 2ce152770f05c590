"""Image requests are prepared off the event loop (engine/multimodal/processor.py): while the model's processor is
stuck on one client's image, another client's stream runs to its end; the processor runs once per request and
never on the server's loop; its refusals keep their 422. `--image-fetch deny` refuses http(s) image URLs with a
422 naming the flag while data: URLs work. Unit tests: a FakeEngine and a processor stub."""
from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

pytest.importorskip("PIL")
torch = pytest.importorskip("torch")

from images import data_url, png  # noqa: E402
from test_server import FakeEngine, make_app, sse_events, uvicorn_server  # noqa: E402

from engine.multimodal.image_source import ImageError, ImageLimits, load_image  # noqa: E402
from engine.multimodal.processor import VisionProcessor  # noqa: E402

IMAGE = 5   # the stub's image token id (the FakeEngine's tokenizer decodes ids below 10 to nothing)


class ImageFakeEngine(FakeEngine):
    def add_request(self, request_id, prompt_token_ids, params, images=None) -> None:
        super().add_request(request_id, prompt_token_ids, params)


class StubProcessor:
    """The processor API VisionProcessor uses; four image tokens per image. `hold` blocks each call until
    `release` is set; `fail` raises as a processor refusing an image does."""

    image_token = "<image>"

    def __init__(self, tokenizer, hold: bool = False, fail: bool = False) -> None:
        self.tokenizer = tokenizer
        self.entered, self.release = threading.Event(), threading.Event()
        self.hold, self.fail = hold, fail
        self.on_loop: list[bool] = []   # per call: whether it ran on a thread with a running event loop

    def __call__(self, text, images, return_tensors, add_special_tokens):
        self.on_loop.append(_has_running_loop())
        self.entered.set()
        if self.hold:
            assert self.release.wait(60), "the test never released the processor"
        if self.fail:
            raise ValueError("image too wide for this model")
        ids: list[int] = []
        for i, piece in enumerate(text[0].split(self.image_token)):
            ids += ([IMAGE] * 4 if i else []) + self.tokenizer.encode(piece, add_special_tokens=False)
        ids = ([1] if add_special_tokens else []) + ids
        return {"input_ids": torch.tensor([ids]), "pixel_values": torch.zeros(len(images), 3, 2, 2)}


def _has_running_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def serve(processor_kw: dict | None = None, limits: ImageLimits | None = None):
    app, engine, fake = make_app(ImageFakeEngine())
    processor = StubProcessor(fake.tokenizer, **(processor_kw or {}))
    app.state.server.validator.vision = VisionProcessor(processor, IMAGE, limits or ImageLimits(), 2)
    return app, engine, processor


def chat(url: str, image_url: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=60, json={"max_tokens": 3, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Describe"},
                                     {"type": "image_url", "image_url": {"url": image_url}}]}]})


def test_a_stuck_image_does_not_stall_another_clients_stream():
    app, engine, processor = serve({"hold": True})
    slow: dict[str, httpx.Response] = {}
    try:
        with uvicorn_server(app) as url:
            def send_image():
                slow["answer"] = httpx.post(f"{url}/generate", timeout=120, json={
                    "inputs": f"Look ![]({data_url(png(1))}) now", "parameters": {"max_new_tokens": 3}})
            image_client = threading.Thread(target=send_image)
            image_client.start()
            assert processor.entered.wait(60)
            # the processor is stuck on that image: on the event loop it would stall this stream (the timeout
            # is only a guard against hanging the suite)
            with httpx.stream("POST", f"{url}/generate_stream", timeout=30,
                              json={"inputs": "hello", "parameters": {"max_new_tokens": 5}}) as stream:
                events = sse_events(stream.read().decode())
            assert '"generated_text":"the q"' in events[-1]
            assert not slow and image_client.is_alive()     # the image request is still in its processor
            processor.release.set()
            image_client.join(60)
            assert slow["answer"].status_code == 200, slow["answer"].text
            assert slow["answer"].json()["generated_text"] == "the"
    finally:
        processor.release.set()
        engine.close()
    assert processor.on_loop == [False]


def test_each_route_processes_its_images_once_and_off_the_loop():
    app, engine, processor = serve()
    try:
        with uvicorn_server(app) as url:
            picture = data_url(png(2))
            assert chat(url, picture).status_code == 200
            answer = httpx.post(f"{url}/v1/completions", timeout=60,
                                json={"prompt": [f"A ![]({picture})", f"A ![]({picture})"], "max_tokens": 2})
            assert answer.status_code == 200 and len(answer.json()["choices"]) == 2
            messages = httpx.post(f"{url}/v1/messages", timeout=60, json={
                "model": "fake-model", "max_tokens": 2, "messages": [{"role": "user", "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                 "data": picture.split(",", 1)[1]}}]}]})
            assert messages.status_code == 200, messages.text
    finally:
        engine.close()
    assert processor.on_loop == [False] * 4     # chat, two completion prompts, messages: never prepared twice


def test_refusals_keep_their_422():
    app, engine, processor = serve({"fail": True})
    try:
        with uvicorn_server(app) as url:
            refused = chat(url, data_url(png(3)))
            assert refused.status_code == 422 and refused.json()["error_type"] == "validation"
            assert refused.json()["error"].endswith("the model's processor refused the images: ValueError: image "
                                                    "too wide for this model")
            broken = chat(url, "data:image/png;base64,aGVsbG8=")
            assert broken.status_code == 422 and "cannot be decoded" in broken.json()["error"]
            too_many = httpx.post(f"{url}/generate", timeout=60, json={
                "inputs": "![](data:image/png;base64,AA==)" * 3, "parameters": {"max_new_tokens": 2}})
            assert too_many.status_code == 422 and "--max-images-per-request 2" in too_many.json()["error"]
            assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    finally:
        engine.close()


def test_prepared_prompts_are_taken_once_each_and_bounded():
    processor = StubProcessor(FakeEngine().tokenizer)
    vision = VisionProcessor(processor, IMAGE, ImageLimits(), 2)
    text = f"Two of ![]({data_url(png(4))})"
    vision.prefetch(text, False)
    vision.prefetch(text, False)
    first, second = vision.prepare(text, False), vision.prepare(text, False)
    assert first[0] == second[0] and first[0][-4:] == [IMAGE] * 4 and len(processor.on_loop) == 2
    assert vision.prepare(text, True)[0][0] == 1 and len(processor.on_loop) == 3   # nothing left: prepared in place
    for i in range(100):    # requests refused between prefetch and validation leave a bounded remainder
        vision.prefetch(f"{i} ![]({data_url(png(4))})")
    assert sum(map(len, vision._ready.values())) <= 32


def test_image_fetch_deny_refuses_http_urls_and_keeps_data_urls():
    deny = ImageLimits(fetch_urls=False)
    for url in ("http://10.0.0.1/internal.png", "https://example.org/cat.png"):
        with pytest.raises(ImageError, match="--image-fetch deny"):
            load_image(url, deny)
    assert load_image(data_url(png(5)), deny).image.size == (40, 30)
    app, engine, processor = serve(limits=deny)
    try:
        with uvicorn_server(app) as url:
            refused = chat(url, "http://169.254.169.254/latest/meta-data.png")
            assert refused.status_code == 422 and refused.json()["error_type"] == "validation"
            assert "--image-fetch deny" in refused.json()["error"]
            assert chat(url, data_url(png(5))).status_code == 200
    finally:
        engine.close()


def test_image_fetch_flag_reaches_the_config():
    from engine.launcher import parse_args, to_config

    assert to_config(parse_args(["--model-id", "m"], environ={}), "m").image_fetch == "allow"
    assert to_config(parse_args(["--model-id", "m", "--image-fetch", "deny"], environ={}), "m").image_fetch == "deny"
    assert to_config(parse_args(["--model-id", "m"], environ={"IMAGE_FETCH": "deny"}), "m").image_fetch == "deny"
    with pytest.raises(SystemExit):
        parse_args(["--model-id", "m", "--image-fetch", "maybe"], environ={})
