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
