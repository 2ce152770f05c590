"""EncoderCache: the vision encoder's outputs of the requests whose prefill still has image tokens to run.

The encoder runs once per request (all its images in one call); its output rows stay here, keyed by sequence,
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
        self.num_encoded = 0          # encoder calls so far

    def embeddings(self, spans: Sequence[SeqSpan]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows of the step's flattened tokens, encoder outputs for them), or None when no span has images."""
        rows: list[int] = []
        parts: list[torch.Tensor] = []
        kept: dict[int, torch.Tensor] = {}
        offset = 0
        for span in spans:
            images: MultiModalPrompt | None = span.images
            if images is not None:
                features = self.features.get(span.seq_id)
                if features is None:
                    features = self._encode(images)
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

    def _encode(self, images: MultiModalPrompt) -> torch.Tensor:
        features = self.encode(images.encoder_inputs)
        self.num_encoded += 1
        if features.shape[0] != len(images.positions):
            raise ValueError(f"the vision encoder gave {features.shape[0]} embeddings for "
                             f"{len(images.positions)} image tokens")
        return features
