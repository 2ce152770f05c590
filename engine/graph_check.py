"""The start-up check a graph path of the forward passes before any step uses it (engine/cuda_graphs.py,
engine/piecewise_graphs.py): a probe step through it and through the eager forward, on the same cache scribbled
with finite values, must agree; otherwise, or when the probe raises, the engine runs those steps eagerly."""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)


def tolerance(dtype: torch.dtype) -> float:
    """How far a graph path may stray from the eager forward, relative to 1 + its largest value."""
    return 1e-3 if dtype == torch.float32 else 5e-2


@torch.inference_mode()
def agrees(what: str, fallback: str, attention_layers: list, num_blocks: int, device: torch.device,
           probe: Callable[[], tuple[torch.Tensor, torch.Tensor]], tolerance: float) -> bool:
    """`probe()` -> (eager, graphed) hidden states of one step over the cache's first `num_blocks` blocks, which it
    may read and write: nothing else owns them yet at start-up. `what` fails its check and `fallback` is logged."""
    generator = torch.Generator(device=device).manual_seed(0)
    try:
        for layer in attention_layers:   # a finite context (an empty cache may hold NaN bit patterns)
            for cache in (layer.k_cache, layer.v_cache):
                cache[:num_blocks] = torch.randn(cache[:num_blocks].shape, generator=generator, device=device,
                                                 dtype=cache.dtype)
        eager, graphed = (hidden.float() for hidden in probe())
    except Exception as error:   # a kernel or capture problem must not take the engine down
        logger.warning("%s failed their self-check (%s): %s", what, error, fallback)
        return False
    error = (eager - graphed).abs().max().item()
    if not error <= tolerance * (1.0 + eager.abs().max().item()):
        logger.warning("%s disagree with the eager forward (max error %.3g): %s", what, error, fallback)
        return False
    return True
