"""EncoderCache: the vision encoder's outputs of the requests whose prefill still has image tokens to run.

The encoder runs once per request, and the requests of a step whose encoder inputs have the same shapes but
for the first dimension (e.g. LLaVA's pixel_values [images, 3, H, W]) share one call; its output rows stay here,
keyed by sequence,
until a span has run past the request's last image token, so a chunk boundary may fall anywhere inside an
image. An entry whose sequence has no span in a step is dropped (aborted, preempted or waiting for budget):
a later span encodes again, which costs time but never changes the result.

A failing encoder call fails only its own requests: `encode` (the engine calls it before the step's forward)
retries each request of a failed shared call alone and returns why each request that still fails failed; the
engine ends those requests with that error and runs the step without them.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
import logging
from typing import Any

import torch

from engine.batch import SeqSpan
from engine.multimodal.prompt import MultiModalPrompt

logger = logging.getLogger(__name__)


class EncoderCache:
    def __init__(self, encode: Callable[[dict[str, Any]], torch.Tensor]) -> None:
        self.encode_fn = encode       # encoder inputs -> [image tokens, hidden] in image-token order
        self.features: dict[int, torch.Tensor] = {}
        self.num_calls = 0            # encoder calls so far
        self.num_encoded = 0          # requests encoded so far

    def embeddings(self, spans: Sequence[SeqSpan]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows of the step's flattened tokens, encoder outputs for them), or None when no span has images."""
        rows: list[int] = []
        parts: list[torch.Tensor] = []
        kept: dict[int, torch.Tensor] = {}
        offset = 0
        failed = self.encode(spans)
        if failed:  # the engine drops these requests before the forward; a caller that did not ask gets the error
            raise ValueError(next(iter(failed.values())))
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

    def encode(self, spans: Sequence[SeqSpan]) -> dict[int, str]:
        """Encode the requests of this step that have no cached output, grouped by input shapes; returns
        seq_id -> why, for the requests whose images the encoder failed on (nothing of theirs is kept)."""
        groups: dict[tuple, list[SeqSpan]] = {}
        for span in spans:
            if span.images is not None and span.seq_id not in self.features:
                inputs = span.images.encoder_inputs
                shape = tuple((k, tuple(v.shape[1:]), v.dtype) for k, v in sorted(inputs.items()))
                groups.setdefault(shape, []).append(span)
        failed: dict[int, str] = {}
        for group in groups.values():
            try:
                self._encode_group(group)
            except Exception as error:  # noqa: BLE001 - one request's images must not fail the others
                if len(group) == 1:
                    failed[group[0].seq_id] = _why(error)
                    continue
                logger.warning("vision encoder failed on %d requests together (%s); encoding each alone",
                               len(group), _why(error))
                for span in group:
                    try:
                        self._encode_group([span])
                    except Exception as error:  # noqa: BLE001
                        failed[span.seq_id] = _why(error)
        for seq_id, why in failed.items():
            logger.warning("vision encoder failed on sequence %d: %s", seq_id, why)
        return failed

    def _encode_group(self, group: list[SeqSpan]) -> None:
        """One encoder call for requests whose inputs have the same shapes (but the first dimension)."""
        prompts: list[MultiModalPrompt] = [span.images for span in group]
        keys = prompts[0].encoder_inputs
        inputs = keys if len(prompts) == 1 else {k: torch.cat([p.encoder_inputs[k] for p in prompts]) for k in keys}
        features = self.encode_fn(inputs)
        self.num_calls += 1
        sizes = [len(p.positions) for p in prompts]
        if features.shape[0] != sum(sizes):
            raise ValueError(f"the vision encoder gave {features.shape[0]} embeddings for {sum(sizes)} image tokens")
        self.num_encoded += len(prompts)
        for span, rows in zip(group, features.split(sizes)):
            self.features[span.seq_id] = rows


def _why(error: Exception) -> str:
    return f"the vision encoder failed on this request's images: {type(error).__name__}: {error}"
