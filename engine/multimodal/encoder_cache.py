"""EncoderCache: the vision encoder's outputs of the requests whose prefill still has image tokens to run.

The encoder runs once per request, and the requests of a step whose encoder inputs have the same shapes but
for the first dimension (e.g. LLaVA's pixel_values [images, 3, H, W]) share one call; its output rows stay here,
keyed by sequence,
until a span has run past the request's last image token, so a chunk boundary may fall anywhere inside an
image. An entry whose sequence has no span in a step is dropped (aborted, preempted or waiting for budget):
a later span encodes again, which costs time but never changes the result.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from engine.batch import SeqSpan
from engine.multimodal.prompt import MultiModalPrompt


class EncoderCache:
    def __init__(self, encode: Callable[[dict[str, Any]], torch.Tensor]) -> None:
        self.encode = encode          # encoder inputs -> [image tokens, hidden] in image-token order
        self.features: dict[int, torch.Tensor] = {}
        self.num_calls = 0            # encoder calls so far
        self.num_encoded = 0          # requests encoded so far

    def embeddings(self, spans: Sequence[SeqSpan]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows of the step's flattened tokens, encoder outputs for them), or None when no span has images."""
        rows: list[int] = []
        parts: list[torch.Tensor] = []
        kept: dict[int, torch.Tensor] = {}
        offset = 0
        self._encode_new(spans)
        for span in spans:
            images: MultiModalPrompt | None = span.images
            if images is not None:
                features = self.features[span.seq_id]
                end = span.start_pos + len(span.token_ids)
                lo, hi = images.rows_in(span.start_pos, end)
                rows += (offset + p - span.start_pos for p in images.positions[lo:hi])
                parts.append(features[lo:hi])
                if end < images.end:
                    kept[span.seq_id] = features
            offset += len(span.token_ids)
        self.features = kept
        if not rows:
            return None
        features = torch.cat(parts)
        return torch.tensor(rows, dtype=torch.int64, device=features.device), features

    def _encode_new(self, spans: Sequence[SeqSpan]) -> None:
        """Encode the requests of this step that have no cached output, grouped by input shapes."""
        groups: dict[tuple, list[SeqSpan]] = {}
        for span in spans:
            if span.images is not None and span.seq_id not in self.features:
                inputs = span.images.encoder_inputs
                shape = tuple((k, tuple(v.shape[1:]), v.dtype) for k, v in sorted(inputs.items()))
                groups.setdefault(shape, []).append(span)
        for group in groups.values():
            prompts: list[MultiModalPrompt] = [span.images for span in group]
            keys = prompts[0].encoder_inputs
            inputs = keys if len(prompts) == 1 else {k: torch.cat([p.encoder_inputs[k] for p in prompts]) for k in keys}
            features = self.encode(inputs)
            self.num_calls += 1
            self.num_encoded += len(prompts)
            sizes = [len(p.positions) for p in prompts]
            if features.shape[0] != sum(sizes):
                raise ValueError(f"the vision encoder gave {features.shape[0]} embeddings for {sum(sizes)} image "
                                 "tokens")
            for span, rows in zip(group, features.split(sizes)):
                self.features[span.seq_id] = rows
