"""MultiModalPrompt: what a request's images add to its token ids, from the processor to the worker."""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(slots=True, eq=False)
class MultiModalPrompt:
    """The vision encoder's inputs and where its outputs go.

    `positions`: the prompt positions of the image tokens, in order; the encoder's output rows (all images
    flattened) go there one for one. `keys`: (position of an image's first token, content hash) per image; the
    prefix-cache block holding that position mixes the hash into its key, and the hash chain carries it to
    every later block, so equal token ids with different images never share KV.

    `bidirectional` (Gemma 3): each run of consecutive image tokens attends to itself both ways, as transformers'
    mask from `token_type_ids` does; `runs` are those [start, end) ranges. A prefill chunk then must not end inside
    a run (`chunk_end`), else the run's first tokens would miss its later ones; a chunk may start inside one (the
    prefix cache holds the run's earlier blocks, computed over the whole run).

    `rope_positions` and `rope_delta`: the prompt's M-RoPE positions [3, prompt tokens] and the offset of every
    later token's (engine/multimodal/mrope.py), for models with M-RoPE (Qwen2-VL); else None and 0.
    """

    encoder_inputs: dict[str, Any]      # the processor's tensors for the vision encoder (pixel_values, ...)
    positions: list[int]
    keys: list[tuple[int, int]]
    num_images: int
    bidirectional: bool = False
    rope_positions: Any = None          # torch.Tensor [3, prompt tokens]
    rope_delta: int = 0
    runs: list[tuple[int, int]] = field(init=False)

    def __post_init__(self) -> None:
        self.runs = _runs(self.positions) if self.bidirectional else []

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

    def attending_both_ways(self, max_chunk: int) -> MultiModalPrompt:
        """This prompt for a model whose image runs attend both ways; ValueError (a 422) when a run is longer than
        a prefill chunk of `max_chunk` tokens can be."""
        prompt = replace(self, bidirectional=True)
        if prompt.longest_run > max_chunk:
            raise ValueError(f"an image of {prompt.longest_run} tokens attends to itself both ways, so it runs in "
                             f"one prefill chunk, and chunks hold at most {max_chunk} tokens "
                             "(--max-batch-prefill-tokens)")
        return prompt

    def chunk_end(self, start: int, end: int) -> int:
        """The end of a prefill chunk [start, end) moved back to the start of a run it would cut (to `start`
        when the chunk starts inside that run: nothing of it can run yet)."""
        for run_start, run_end in self.runs:
            if run_start < end < run_end:
                return max(run_start, start)
        return end

    def runs_in(self, start: int, end: int) -> list[tuple[int, int]]:
        """The runs that share a token with [start, end)."""
        return [(s, e) for s, e in self.runs if s < end and e > start]

    @property
    def longest_run(self) -> int:
        return max((e - s for s, e in self.runs), default=0)


def _runs(positions: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of consecutive positions."""
    runs: list[tuple[int, int]] = []
    for position in positions:
        if runs and runs[-1][1] == position:
            runs[-1] = (runs[-1][0], position + 1)
        else:
            runs.append((position, position + 1))
    return runs
