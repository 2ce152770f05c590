"""VisionProcessor: a prompt with images -> token ids + MultiModalPrompt, by the model's own processor.

Images reach the prompt as TGI's markdown `![](URL)` (the chat routes write each `image_url` part that way, as
TGI's router does); each becomes the processor's image placeholder, which the processor expands into the
model's image tokens (their number depends on the image for some families). Families whose chat template wraps
each image in marker tokens (Qwen2-VL's <|vision_start|>...<|vision_end|>) get the wrapped placeholder. A processor
that also takes videos (Qwen2-VL's) is built without its video processor, which needs torchvision: the engine serves
no video.
"""
from __future__ import annotations

import re
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

from engine.multimodal import mrope
from engine.multimodal.image_source import ImageData, ImageError, ImageLimits, load_image
from engine.multimodal.prompt import MultiModalPrompt

Prepared = tuple[list[int], MultiModalPrompt | None]
_MAX_READY = 32     # prepared prompts whose requests were refused before validation took them, kept at most

MARKDOWN_IMAGE = re.compile(r"!\[[^\]\n]*\]\(([^)\s]+)\)")


def markdown_image(url: str) -> str:
    """`url` as TGI's markdown image; a URL that the markdown could not hold whole is refused (ValueError)."""
    text = f"![]({url})"
    if MARKDOWN_IMAGE.fullmatch(text) is None:
        raise ImageError("an image URL cannot contain whitespace or ')' (percent-encode them)")
    return text


class VisionProcessor:
    """The model's processor under the server's image limits.

    Loading, decoding and processing a request's images takes long (a fetch, a large decode, the processor's
    resizing), so the routes run `prefetch` in a worker thread first (engine/server/openai_requests.py
    `prefetch_images`); it leaves the outcome, the prompt or the ImageError that refuses it, for `prepare`, which
    validation calls on the event loop. A prompt nobody prefetched is prepared in place, as before.
    """

    def __init__(self, processor: Any, image_token_id: int, limits: ImageLimits, max_images: int,
                 markers: tuple[str, str] = ("", ""), mrope_merge_size: int | None = None) -> None:
        self.processor = processor
        self.image_token: str = processor.image_token
        self.placeholder = markers[0] + self.image_token + markers[1]   # what each markdown image becomes
        self.image_token_id = image_token_id
        self.mrope_merge_size = mrope_merge_size    # M-RoPE models: patches per token along each side
        self.limits = limits
        self.max_images = max_images
        # (text, add_special_tokens) -> outcomes made by prefetch, taken by prepare (one per request)
        self._ready: OrderedDict[tuple[str, bool], list[Prepared | ImageError]] = OrderedDict()
        self._lock = threading.Lock()
        self._processing = threading.Lock()  # one processor call at a time: its tokenizer is not thread-safe

    @classmethod
    def from_pretrained(cls, path: str | Path, image_token_id: int, limits: ImageLimits,
                        max_images: int) -> VisionProcessor:
        from transformers import AutoConfig, AutoProcessor
        from transformers.models.auto.processing_auto import PROCESSOR_MAPPING

        config = AutoConfig.from_pretrained(str(path))
        processor_cls = PROCESSOR_MAPPING.get(type(config), None)
        try:
            if processor_cls is not None and "video_processor" in processor_cls.get_attributes():
                processor = _without_videos(processor_cls).from_pretrained(str(path))
            else:
                processor = AutoProcessor.from_pretrained(str(path))
        except ImportError as exc:  # e.g. PixtralProcessor without torchvision, SmolVLM's without num2words
            reason = " ".join(str(exc).split()).split(". ")[0].rstrip(".") or type(exc).__name__
            raise ValueError(f"the model's processor cannot load: {reason} (docs/models.md says what each "
                             "family needs)") from None
        markers = [getattr(config, f"vision_{side}_token_id", None) for side in ("start", "end")]
        return cls(processor, image_token_id, limits, max_images,
                   tuple(processor.tokenizer.convert_ids_to_tokens(markers)) if None not in markers else ("", ""),
                   config.vision_config.spatial_merge_size if config.model_type in mrope.MODEL_TYPES else None)

    def has_images(self, text: str) -> bool:
        return MARKDOWN_IMAGE.search(text) is not None

    def prepare(self, text: str, add_special_tokens: bool = True) -> tuple[list[int], MultiModalPrompt | None]:
        """Token ids of `text` with its markdown images loaded and expanded (ImageError: 422 material)."""
        with self._lock:
            waiting = self._ready.get((text, add_special_tokens))
            outcome = waiting.pop() if waiting else None     # the newest: a stale one is an older request's
            if waiting == []:
                del self._ready[(text, add_special_tokens)]
        if outcome is None:
            return self._prepare(text, add_special_tokens)
        if isinstance(outcome, ImageError):
            raise outcome
        return outcome

    def prefetch(self, text: str, add_special_tokens: bool = True) -> None:
        """Load and process the images of `text` now, in the caller's thread (not the event loop's); the next
        `prepare` of the same text takes the outcome."""
        try:
            outcome: Prepared | ImageError = self._prepare(text, add_special_tokens)
        except ImageError as exc:
            outcome = exc
        with self._lock:
            key = (text, add_special_tokens)
            self._ready.setdefault(key, []).append(outcome)
            self._ready.move_to_end(key)
            while sum(map(len, self._ready.values())) > _MAX_READY:  # requests refused before validation
                self._ready.popitem(last=False)

    def _prepare(self, text: str, add_special_tokens: bool) -> Prepared:
        urls = MARKDOWN_IMAGE.findall(text)
        if not urls:
            return list(self.processor.tokenizer.encode(text, add_special_tokens=add_special_tokens)), None
        if len(urls) > self.max_images:
            raise ImageError(f"the request has {len(urls)} images, more than --max-images-per-request "
                             f"{self.max_images}")
        if self.image_token in MARKDOWN_IMAGE.sub("", text):
            raise ImageError(f"the text itself contains the image placeholder {self.image_token!r}")
        images = [load_image(url, self.limits) for url in urls]
        return self.process(MARKDOWN_IMAGE.sub(lambda _: self.placeholder, text), images, add_special_tokens)

    def process(self, text: str, images: list[ImageData],
                add_special_tokens: bool = True) -> tuple[list[int], MultiModalPrompt]:
        """`text` with one placeholder per image of `images`."""
        try:
            with self._processing:
                out = self.processor(text=[text], images=[image.image for image in images], return_tensors="pt",
                                     add_special_tokens=add_special_tokens)
        except Exception as exc:  # noqa: BLE001 - whatever the processor makes of an image is about that image: a 422
            raise ImageError(f"the model's processor refused the images: {type(exc).__name__}: {exc}") from None
        ids = out["input_ids"][0].tolist()
        positions = [i for i, token in enumerate(ids) if token == self.image_token_id]
        if not positions:
            raise ImageError("the model's processor placed no image tokens (is the image too small for this model?)")
        encoder_inputs = {k: v for k, v in out.items()
                          if k not in ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")}
        prompt = MultiModalPrompt(encoder_inputs, positions, _image_keys(positions, images), len(images))
        if self.mrope_merge_size is not None:
            try:
                prompt.rope_positions, prompt.rope_delta = mrope.prompt_positions(
                    ids, self.image_token_id, out["image_grid_thw"], self.mrope_merge_size)
            except ValueError as exc:
                raise ImageError(f"the model's processor placed image tokens that its image grids do not "
                                 f"explain: {exc}") from None
        return ids, prompt


def _without_videos(processor_cls: type) -> type:
    """`processor_cls` without its video processor (transformers' video processors need torchvision, and the engine
    serves no video): its own __init__ gets video_processor=None and passes the mixin one processor fewer."""

    class ImagesOnly(processor_cls):  # type: ignore[misc, valid-type]
        def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: str | None = None,
                     **kwargs: Any) -> None:
            super().__init__(image_processor=image_processor, tokenizer=tokenizer, video_processor=None,
                             chat_template=chat_template, **kwargs)

    ImagesOnly.__name__ = ImagesOnly.__qualname__ = processor_cls.__name__
    return ImagesOnly


def _image_keys(positions: list[int], images: list[ImageData]) -> list[tuple[int, int]]:
    """(first token, hash) per image where each image is one run of image tokens; else the hash of all images at
    the first image token (families that split an image into several runs)."""
    starts = [p for i, p in enumerate(positions) if i == 0 or positions[i - 1] != p - 1]
    if len(starts) == len(images):
        return [(start, image.key) for start, image in zip(starts, images)]
    return [(starts[0], hash(tuple(image.key for image in images)))]
