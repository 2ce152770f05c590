"""Reading one image a request names: a `data:` URL (base64) or an http(s) URL, under size, type and time limits.

An http(s) URL is fetched from the server's node, whatever address it names (cluster-internal ones included),
as TGI does; `--image-fetch deny` (ImageLimits.fetch_urls False) refuses them all with a 422."""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
from dataclasses import dataclass
from typing import Any

IMAGE_TYPES = ("image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif", "image/bmp")
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")  # Pillow's decoders tried, whatever the type the request named
_DATA_URL = re.compile(r"data:(?P<type>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,",
                       re.ASCII)


class ImageError(ValueError):
    """The request's image cannot be used; the message says why (a 422)."""


@dataclass(frozen=True, slots=True)
class ImageLimits:
    max_bytes: int = 20 * 2**20         # encoded size
    max_pixels: int = 4096 * 4096       # decoded width x height (decompression bombs)
    max_aspect_ratio: float = 200.0     # long side / short side: processors that resize the short side to a fixed
                                        # size would turn a 1 x 16M-pixel strip into gigabytes (Qwen2-VL's own bound)
    fetch_timeout_s: float = 10.0       # an http(s) image, connect + whole body
    fetch_urls: bool = True             # False (--image-fetch deny): http(s) URLs are refused, data: URLs only


@dataclass(frozen=True, slots=True)
class ImageData:
    image: Any      # PIL.Image.Image, RGB
    key: int        # content hash of the encoded bytes: keys prefix-cache blocks


def load_image(url: str, limits: ImageLimits) -> ImageData:
    if not isinstance(url, str) or not url:
        raise ImageError("an image URL must be a non-empty string")
    if url.startswith("data:"):
        data = _from_data_url(url, limits)
    elif url.startswith(("http://", "https://")):
        if not limits.fetch_urls:
            raise ImageError(f"this server does not fetch http(s) image URLs such as {_short(url)!r} "
                             "(--image-fetch deny): send the image as a data:image/...;base64 URL")
        data = _fetch(url, limits)
    else:
        raise ImageError(f"image URL {_short(url)!r} is neither a data: URL nor http(s)")
    return decode(data, limits)


def decode(data: bytes, limits: ImageLimits) -> ImageData:
    from PIL import Image, ImageOps, UnidentifiedImageError

    if len(data) > limits.max_bytes:
        raise ImageError(f"the image has {len(data)} bytes, more than the limit of {limits.max_bytes}")
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)  # not Pillow's rarer decoders (TIFF, TGA, ...)
        if image.width * image.height > limits.max_pixels:
            raise ImageError(f"the image has {image.width}x{image.height} pixels, more than the limit of "
                             f"{limits.max_pixels}")
        if max(image.size) > limits.max_aspect_ratio * min(image.size):
            raise ImageError(f"the image is {image.width}x{image.height} pixels, an aspect ratio over the limit of "
                             f"{limits.max_aspect_ratio:g}")
        image = ImageOps.exif_transpose(image).convert("RGB")  # upright, as transformers' load_image does
    except ImageError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise ImageError(f"the image cannot be decoded: {exc}") from None
    return ImageData(image, int.from_bytes(hashlib.sha256(data).digest()[:8], "little"))


def _from_data_url(url: str, limits: ImageLimits) -> bytes:
    match = _DATA_URL.match(url)
    if match is None:
        raise ImageError("malformed data: URL (expected data:image/<type>;base64,<data>)")
    kind = (match["type"] or "").lower()
    if kind not in IMAGE_TYPES:
        raise ImageError(f"content type {kind or 'none'!r} is not an image type ({', '.join(IMAGE_TYPES)})")
    if not match["b64"]:
        raise ImageError("a data: URL image must be base64-encoded (;base64,)")
    payload = url[match.end():]
    if len(payload) > limits.max_bytes * 4 // 3 + 4:
        raise ImageError(f"the image is larger than the limit of {limits.max_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the data: URL is not valid base64") from None


def _fetch(url: str, limits: ImageLimits) -> bytes:
    import httpx

    try:
        with httpx.Client(timeout=limits.fetch_timeout_s, follow_redirects=True, max_redirects=3) as client, \
                client.stream("GET", url) as response:
            if response.status_code != 200:
                raise ImageError(f"fetching image {_short(url)!r} failed: HTTP {response.status_code}")
            kind = response.headers.get("content-type", "").split(";")[0].strip().lower()
            if kind and kind not in IMAGE_TYPES and kind != "application/octet-stream":
                raise ImageError(f"{_short(url)!r} is {kind!r}, not an image type ({', '.join(IMAGE_TYPES)})")
            declared = response.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > limits.max_bytes:
                raise ImageError(f"the image has {declared} bytes, more than the limit of {limits.max_bytes}")
            body = bytearray()
            for chunk in response.iter_bytes():
                body += chunk
                if len(body) > limits.max_bytes:
                    raise ImageError(f"the image is larger than the limit of {limits.max_bytes} bytes")
            return bytes(body)
    except httpx.TimeoutException:
        raise ImageError(f"fetching image {_short(url)!r} took longer than {limits.fetch_timeout_s:g} s") from None
    except httpx.HTTPError as exc:
        raise ImageError(f"this server cannot fetch image {_short(url)!r}: {type(exc).__name__}: {exc}") from None


def _short(url: str) -> str:
    return url if len(url) <= 80 else url[:77] + "..."
