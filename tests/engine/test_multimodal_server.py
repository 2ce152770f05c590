"""Images over HTTP (engine/multimodal): the real `openai` client sends a data-URL image to `python -m engine`
serving a tiny LLaVA, a repeated image is read from the prefix cache and a different one is not, images come by
http(s) URL (a local server) and as TGI's markdown on /generate; hostile images (bad encodings, truncated,
decompression bombs, extreme strips, non-image types, unreachable URLs...) get a 422 with error_type, odd but valid
ones (1x1, CMYK, animated GIF, 16-bit, palette, a JPEG labelled PNG) are served, and the server keeps serving; a
text-only model refuses images."""
import base64
import http.server
import socket
import threading

import httpx
import pytest

pytest.importorskip("torch")
pytest.importorskip("PIL")
openai = pytest.importorskip("openai")

from fakes import test_model_path  # noqa: E402
from images import data_url, encoded, odd_images, png  # noqa: E402
from test_clients import start_server, stop_server  # noqa: E402

MAX_BYTES = 8 * 1024


class Images(http.server.BaseHTTPRequestHandler):
    fetches: list[str] = []

    def do_GET(self):
        self.fetches.append(self.path)
        body, kind = {"/cat.png": (png(3), "image/png"), "/page.html": (b"<html></html>", "text/html")}.get(
            self.path, (b"missing", "text/plain"))
        self.send_response(200 if self.path in ("/cat.png", "/page.html") else 404)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def image_host():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Images)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc, url, log = start_server(test_model_path("tiny-llava"), tmp_path_factory.mktemp("vlm"), "--device", "cpu",
                                  "--max-images-per-request", "2", "--max-image-bytes", str(MAX_BYTES),
                                  "--image-fetch-timeout", "5", "--max-batch-prefill-tokens", "64")
    yield url
    stop_server(proc)


def chat(url, *parts, max_tokens=4, text="Describe"):
    content = [{"type": "text", "text": text}] + [
        {"type": "image_url", "image_url": {"url": part}} for part in parts]
    return httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens})


def test_openai_client_sends_an_image_and_the_prefix_cache_keys_it(server):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none")

    def ask(seed):
        return client.chat.completions.create(model="tiny-llava", max_tokens=5, temperature=0, messages=[
            {"role": "user", "content": [{"type": "text", "text": "What is in this picture?"},
                                         {"type": "image_url", "image_url": {"url": data_url(png(seed))}}]}])

    first = ask(11)
    assert first.choices[0].message.content and first.usage.completion_tokens == 5
    assert first.usage.prompt_tokens > 16   # the image's tokens count as prompt tokens
    again = ask(11)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert again.choices[0].message.content == first.choices[0].message.content
    other = ask(12)
    assert other.usage.prompt_tokens == first.usage.prompt_tokens
    assert other.usage.prompt_tokens_details.cached_tokens == 0  # the image sits in the first block


def test_http_image_and_markdown_on_generate(server, image_host):
    answer = chat(server, f"{image_host}/cat.png")
    assert answer.status_code == 200, answer.text
    answer = httpx.post(f"{server}/generate", timeout=60, json={
        "inputs": f"Look ![]({image_host}/cat.png) here", "parameters": {"max_new_tokens": 3}})
    assert answer.status_code == 200, answer.text
    assert Images.fetches.count("/cat.png") == 2  # fetched off the event loop before validation, and only then
    answer = httpx.post(f"{server}/generate", timeout=60, json={
        "inputs": f"Look ![]({data_url(png(4))}) here", "parameters": {"max_new_tokens": 3}})
    assert answer.status_code == 200, answer.text
    assert answer.json()["generated_text"]
    answer = httpx.post(f"{server}/v1/completions", timeout=60, json={
        "prompt": f"Look ![]({data_url(png(4))}) here", "max_tokens": 3})
    assert answer.status_code == 200 and answer.json()["usage"]["prompt_tokens"] > 16, answer.text


def test_anthropic_client_sends_an_image_block(server):
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=server, api_key="none")
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": base64.b64encode(png(6)).decode()}}]}]
    answer = client.messages.create(model="tiny-llava", max_tokens=3, messages=messages)
    assert answer.content[0].text and answer.usage.input_tokens > 16
    assert client.messages.count_tokens(model="tiny-llava", messages=messages).input_tokens == \
        answer.usage.input_tokens


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("case, parts, message", [
    ("bad base64", ["data:image/png;base64,@@not-base64@@"], "not valid base64"),
    ("space in URL", ["data:image/png;base64,AAAA AAAA"], "cannot contain whitespace"),
    ("not an image", [data_url(b"hello")], "cannot be decoded"),
    ("wrong content type", ["data:text/plain;base64," + base64.b64encode(png(1)).decode()], "not an image type"),
    ("huge image", [data_url(png(1, 200, 200))], "limit of 8192"),
    ("truncated PNG", [data_url(png(1)[:200])], "cannot be decoded"),
    ("decompression bomb", ["{bomb}"], "more than the limit of 16777216"),
    ("a 300x1 strip", ["{strip}"], "aspect ratio over the limit of 200"),
    ("SVG", ["data:image/svg+xml;base64," + base64.b64encode(b"<svg/>").decode()], "not an image type"),
    ("too many images", [data_url(png(1))] * 3, "--max-images-per-request"),
    ("unreachable URL", [f"http://127.0.0.1:{closed_port()}/x.png"], "cannot fetch"),
    ("http page", ["{host}/page.html"], "not an image type"),
    ("missing http image", ["{host}/nothing.png"], "HTTP 404"),
    ("other scheme", ["file:///etc/passwd"], "neither a data: URL nor http"),
    ("placeholder in the text", [], "image token '<image>' but no image"),
    ("placeholder beside an image", [data_url(png(1))], "contains the image placeholder"),
])
def test_hostile_images_are_422(server, image_host, case, parts, message):
    text = "Describe <image>" if "placeholder" in case else "Describe"
    from PIL import Image

    bomb = data_url(encoded(Image.new("1", (4100, 4100)), "PNG"))  # 2 KB, 16.8 M pixels
    strip = data_url(encoded(Image.new("RGB", (300, 1)), "PNG"))
    answer = chat(server, *(part.format(host=image_host, bomb=bomb, strip=strip) for part in parts), text=text)
    assert answer.status_code == 422, (case, answer.text)
    assert answer.json()["error_type"] == "validation" and message in answer.json()["error"], case


@pytest.mark.parametrize("case", list(odd_images()))
def test_odd_but_valid_images_are_served(server, case):
    data, kind = odd_images()[case]
    answer = chat(server, data_url(data, kind), max_tokens=2)
    assert answer.status_code == 200 and answer.json()["usage"]["prompt_tokens"] > 16, (case, answer.text)


def test_the_server_keeps_serving_after_the_hostile_images(server):
    answer = chat(server, data_url(png(5)))
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"], answer.text


def test_text_only_model_refuses_image_parts():
    from starlette.testclient import TestClient

    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.server.app import build_app

    config = EngineConfig(model_id=str(test_model_path("tiny-llama")), device="cpu", dtype="float32",
                          cpu_kv_cache_bytes=4 * 2**20)
    engine = AsyncEngine(LLMEngine(config)).start()
    try:
        with TestClient(build_app(engine, config)) as client:
            answer = chat_client(client, data_url(png(0)))
            assert answer.status_code == 422 and answer.json()["error_type"] == "validation"
            assert "text-only" in answer.json()["error"]
            assert client.post("/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 2}}).status_code \
                == 200
    finally:
        engine.close()


def chat_client(client, url):
    return client.post("/v1/chat/completions", json={"max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Describe"}, {"type": "image_url", "image_url": {"url": url}}]}]})
