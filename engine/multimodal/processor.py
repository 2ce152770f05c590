"""VisionProcessor: a prompt with images -> token ids + MultiModalPrompt, by the model's own processor.

Images reach the prompt as TGI's markdown `![](URL)` (the chat routes write each `image_url` part that way, as
TGI's router does); each becomes the processor's image placeholder, which the processor expands into the
model's image tokens (their number depends on the image for some families).
"""
from __future__ import annotations

import re
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

from engine.multimodal.image_source import ImageData, ImageError, ImageLimits, load_image
from engine.multimodal.prompt import MultiModalPrompt

MARKDOWN_IMAGE = re.compile(r"!\[[^\]\n]*\]\(([^)\s]+)\)")


def markdown_image(url: str) -> str:
    """`url` as TGI's markdown image; a URL that the markdown could not hold whole is refused (ValueError)."""
    text = f"![]({url})"
    if MARKDOWN_IMAGE.fullmatch(text) is None:
        raise ImageError("an image URL cannot contain whitespace or ')' (percent-encode them)")
    return text


class VisionProcessor:
    def __init__(self, path: str | Path, image_token_id: int, limits: ImageLimits, max_images: int) -> None:
        from transformers import AutoProcessor

        self.processor = AutoProcessor.from_pretrained(str(path))
        self.placeholder: str = self.processor.image_token
        self.image_token_id = image_token_id
        self.limits = limits
        self.max_images = max_images
        self._fetched: OrderedDict[str, ImageData | ImageError] = OrderedDict()  # by prefetch, taken by prepare
        self._lock = threading.Lock()

    def has_images(self, text: str) -> bool:
        return MARKDOWN_IMAGE.search(text) is not None

    def prepare(self, text: str, add_special_tokens: bool = True) -> tuple[list[int], MultiModalPrompt | None]:
        """Token ids of `text` with its markdown images loaded and expanded (ImageError: 422 material)."""
        urls = MARKDOWN_IMAGE.findall(text)
        if not urls:
            return list(self.processor.tokenizer.encode(text, add_special_tokens=add_special_tokens)), None
        if len(urls) > self.max_images:
            raise ImageError(f"the request has {len(urls)} images, more than --max-images-per-request "
                             f"{self.max_images}")
        if self.placeholder in MARKDOWN_IMAGE.sub("", text):
            raise ImageError(f"the text itself contains the image placeholder {self.placeholder!r}")
        images = [self._take(url) for url in urls]
        return self.process(MARKDOWN_IMAGE.sub(lambda _: self.placeholder, text), images, add_special_tokens)

    def prefetch(self, text: str) -> None:
        """Fetch the http(s) images of `text` now, off the event loop (the routes run this in a thread before
        validating); `prepare` takes them, or their errors, from here instead of fetching on the loop."""
        for url in MARKDOWN_IMAGE.findall(text)[:self.max_images]:
            if url.startswith(("http://", "https://")):
                try:
                    result: ImageData | ImageError = load_image(url, self.limits)
                except ImageError as exc:
                    result = exc
                with self._lock:
                    self._fetched[url] = result
                    while len(self._fetched) > 4 * self.max_images:  # a request refused before prepare
                        self._fetched.popitem(last=False)

    def _take(self, url: str) -> ImageData:
        with self._lock:
            result = self._fetched.pop(url, None)
        if isinstance(result, ImageError):
            raise result
        return result if result is not None else load_image(url, self.limits)

    def process(self, text: str, images: list[ImageData],
                add_special_tokens: bool = True) -> tuple[list[int], MultiModalPrompt]:
        """`text` with one placeholder per image of `images`."""
        try:
            out = self.processor(text=[text], images=[image.image for image in images], return_tensors="pt",
                                 add_special_tokens=add_special_tokens)
        except Exception as exc:  # noqa: BLE001 - whatever the processor makes of an image is about that image: a 422
            raise ImageError(f"the model's processor refused the images: {type(exc).__name__}: {exc}") from None
        ids = out["input_ids"][0].tolist()
        positions = [i for i, token in enumerate(ids) if token == self.image_token_id]
        if not positions:
            raise ImageError("the model's processor placed no image tokens (is the image too small for this model?)")
        encoder_inputs = {k: v for k, v in out.items() if k not in ("input_ids", "attention_mask", "token_type_ids")}
        return ids, MultiModalPrompt(encoder_inputs, positions, _image_keys(positions, images), len(images))


def _image_keys(positions: list[int], images: list[ImageData]) -> list[tuple[int, int]]:
    """(first token, hash) per image where each image is one run of image tokens; else the hash of all images at
    the first image token (families that split an image into several runs)."""
    starts = [p for i, p in enumerate(positions) if i == 0 or positions[i - 1] != p - 1]
    if len(starts) == len(images):
        return [(start, image.key) for start, image in zip(starts, images)]
    return [(starts[0], hash(tuple(image.key for image in images)))]
