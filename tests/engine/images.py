"""Small random PNG images for the vision-language tests (seeded: the same seed gives the same bytes)."""
import base64
import io


def png(seed: int, width: int = 40, height: int = 30) -> bytes:
    import numpy as np
    from PIL import Image

    pixels = (np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8")
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def data_url(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64,{base64.b64encode(data).decode()}"


def encoded(image, fmt: str, **options) -> bytes:
    """`image` (a PIL image) in file format `fmt`."""
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def odd_images() -> dict[str, tuple[bytes, str]]:
    """Images a client may well send that are not plain RGB PNGs: name -> (bytes, the MIME type sent)."""
    import numpy as np
    from PIL import Image

    rgb = Image.open(io.BytesIO(png(7)))
    grey16 = Image.fromarray((np.random.RandomState(7).rand(30, 40) * 65535).astype("uint16"))
    frames = [rgb, rgb.rotate(90)]
    return {
        "1x1": (png(7, 1, 1), "image/png"),
        "CMYK JPEG": (encoded(rgb.convert("CMYK"), "JPEG"), "image/jpeg"),
        "animated GIF": (encoded(frames[0], "GIF", save_all=True, append_images=frames[1:]), "image/gif"),
        "16-bit grey": (encoded(grey16, "PNG"), "image/png"),
        "palette with transparency": (encoded(rgb.convert("P"), "PNG", transparency=0), "image/png"),
        "JPEG sent as image/png": (encoded(rgb, "JPEG"), "image/png"),
    }
