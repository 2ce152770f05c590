"""Decoding a request's image bytes (engine/multimodal/image_source.py): only PNG, JPEG, WebP, GIF and BMP decoders
run, whatever type the request named; EXIF orientation is applied; limits on pixels and aspect ratio; and corrupted
files of every accepted format (seeded random byte flips, cuts and splices) give an image or an ImageError, never
another exception."""
import io
import random

import pytest

pytest.importorskip("PIL")

from engine.multimodal.image_source import ImageData, ImageError, ImageLimits, decode  # noqa: E402
from images import encoded, odd_images, png  # noqa: E402


def picture():
    from PIL import Image

    return Image.open(io.BytesIO(png(3, 40, 30)))


def test_exif_orientation_is_applied():
    from PIL import Image

    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to display"
    image = decode(encoded(picture(), "JPEG", exif=exif), ImageLimits()).image
    assert image.size == (30, 40) and image.mode == "RGB"


@pytest.mark.parametrize("fmt", ["TIFF", "TGA", "PPM", "ICO"])
def test_other_formats_are_refused(fmt):
    with pytest.raises(ImageError, match="cannot be decoded"):
        decode(encoded(picture(), fmt), ImageLimits())


def test_pixel_and_aspect_ratio_limits():
    from PIL import Image

    with pytest.raises(ImageError, match="more than the limit of 1000"):
        decode(encoded(Image.new("1", (40, 30)), "PNG"), ImageLimits(max_pixels=1000))
    with pytest.raises(ImageError, match="aspect ratio over the limit of 4"):
        decode(encoded(Image.new("RGB", (1, 5)), "PNG"), ImageLimits(max_aspect_ratio=4))
    assert decode(encoded(Image.new("RGB", (1, 4)), "PNG"), ImageLimits(max_aspect_ratio=4)).image.size == (1, 4)


def test_corrupted_files_give_an_image_or_an_image_error():
    rng = random.Random(0)
    seeds = [encoded(picture(), fmt) for fmt in ("PNG", "JPEG", "GIF", "BMP", "WEBP")]
    seeds += [data for data, _ in odd_images().values()]
    outcomes = {"image": 0, "refused": 0}
    for data in seeds:
        for _ in range(100):
            mutated = bytearray(data)
            for _ in range(rng.randint(1, 6)):
                at = rng.randrange(len(mutated))
                kind = rng.random()
                if kind < 0.6:
                    mutated[at] = rng.randrange(256)
                elif kind < 0.8:
                    del mutated[at:]
                else:
                    mutated[at:at + rng.randint(1, 16)] = rng.randbytes(rng.randint(1, 64))
                if not mutated:
                    break
            try:
                assert isinstance(decode(bytes(mutated), ImageLimits()), ImageData)
                outcomes["image"] += 1
            except ImageError:
                outcomes["refused"] += 1
    assert outcomes["image"] > 0 and outcomes["refused"] > 0, outcomes
