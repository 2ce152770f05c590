"""A fast CPU path or its torch fallback, chosen once at start-up from a flag (auto | fast | fallback) and the
fast path's own reason to be unusable (None: it built and passed its self-check)."""
from __future__ import annotations

import logging
from typing import Callable

import torch

logger = logging.getLogger(__name__)


def choose(wanted: str, fast: str, fallback: str, unusable: Callable[[], str | None], *, what: str, flag: str,
           device: torch.device) -> str:
    """`fast` or `fallback`; raises ValueError when `wanted` is unknown or names a fast path that cannot run."""
    choices = ("auto", fast, fallback)
    if wanted not in choices:
        raise ValueError(f"unknown {what} {wanted!r}; use {', '.join(choices)}")
    if wanted == fallback:
        return fallback
    reason = unusable()
    if reason is None:
        return fast
    if wanted == fast:
        raise ValueError(f"{what} {fast!r} is not usable here: {reason}; use {flag} auto")
    if device.type == "cpu":
        logger.info("%s %s not used (%s): %s", what, fast, reason, fallback)
    return fallback


def install_fused(model: torch.nn.Module, attribute: str) -> int:
    """Set `attribute` (a layer's fused-path switch: `fused_cpu`, `fused_gpu`) on `model`'s RMSNorm,
    RotaryEmbedding and SiluAndMul modules, their exact classes only (subclasses that change the formula keep
    theirs). Returns how many modules now take the fused path."""
    from engine.layers.activation import SiluAndMul
    from engine.layers.layernorm import RMSNorm
    from engine.layers.rotary_embedding import RotaryEmbedding

    count = 0
    for module in model.modules():
        if type(module) in (RMSNorm, RotaryEmbedding, SiluAndMul):
            setattr(module, attribute, True)
            count += 1
    return count
