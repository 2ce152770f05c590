"""MultiModalPrompt: what a request's images add to its token ids, from the processor to the worker."""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True, eq=False)
class MultiModalPrompt:
    """The vision encoder's inputs and where its outputs go.

    `positions`: the prompt positions of the image tokens, in order; the encoder's output rows (all images
    flattened) go there one for one. `keys`: (position of an image's first token, content hash) per image; the
    prefix-cache block holding that position mixes the hash into its key, and the hash chain carries it to
    every later block, so equal token ids with different images never share KV. `rope_positions` and
    `rope_delta`: the prompt's M-RoPE positions [3, prompt tokens] and the offset of every later token's
    (engine/multimodal/mrope.py), for models with M-RoPE (Qwen2-VL); else None and 0.
    """

    encoder_inputs: dict[str, Any]      # the processor's tensors for the vision encoder (pixel_values, ...)
    positions: list[int]
    keys: list[tuple[int, int]]
    num_images: int
    rope_positions: Any = None          # torch.Tensor [3, prompt tokens]
    rope_delta: int = 0

    @property
    def end(self) -> int:
        """One past the last image token: spans that start here or later need no encoder output."""
        return self.positions[-1] + 1

    def keys_in(self, start: int, end: int) -> tuple[int, ...]:
        """The content hashes of the images whose first token lies in [start, end)."""
        return tuple(key for position, key in self.keys if start <= position < end)

    def rows_in(self, start: int, end: int) -> tuple[int, int]:
        """The range of image-token indices whose positions lie in [start, end)."""
        return bisect_left(self.positions, start), bisect_left(self.positions, end)
