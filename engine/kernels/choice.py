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
