"""Python's cyclic garbage collector set for a serving process: young collections rarer, start-up objects frozen.

Why: the outputs of a decode step at batch 256 are ~1,300 small container objects (each sequence's TokenInfo, its
list, its RequestOutput and the pending-text tuple), built on the step thread or the event loop's
(engine/deferred_outputs.py). At CPython's default first threshold (700 allocations) that is about two
young-generation collections a step, each walking the live outputs and touching what they point to (sequences,
deferred texts), memory the step's vocabulary-wide work has evicted from the caches: building a step's outputs at
128k columns took 523 us with the default collector and 347 us with it disabled (docs/benchmarks.md, "Host overhead
per decode step"). Nothing in the step loop makes cycles that must be reclaimed soon: its objects die by reference
counting.

How, once per process (`apply`): `gc.freeze()` moves everything alive after start-up (the model's modules, the
tokenizer, the server's routes) out of every later collection, and the first threshold goes to `YOUNG_THRESHOLD`
allocations (the older generations keep their ratios), so a young collection comes every ~15 steps at batch 256
and an old one far less often. `TGI_HPC_GC_TUNING=0`: CPython's defaults stay. The server's launcher applies it
before its step loop; a library user of LLMEngine keeps the process's own settings; `tuned()` applies them for a
while and puts the process's back (`bench_engine.py --host-overhead` inside a test session).
"""
from __future__ import annotations

import contextlib
import gc
import logging
import os
from collections.abc import Iterator

logger = logging.getLogger(__name__)

ENV = "TGI_HPC_GC_TUNING"
YOUNG_THRESHOLD = 20_000
_applied: bool | None = None


def _turned_off() -> bool:
    return os.environ.get(ENV, "1") == "0"


def _tune() -> tuple[int, int, int]:
    """Collect what is garbage now (not frozen with the rest), freeze what is alive, raise the young threshold;
    the thresholds before."""
    before = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, *before[1:])
    return before


@contextlib.contextmanager
def tuned() -> Iterator[bool]:
    """The same settings for a while (a benchmark run inside a test session), then the process's own back."""
    if _turned_off() or _applied:
        yield bool(_applied)
        return
    before = _tune()
    try:
        yield True
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()


def apply() -> bool:
    """Freeze what is alive now and raise the young threshold (once per process); False when turned off."""
    global _applied
    if _applied is not None:
        return _applied
    if _turned_off():
        logger.info("garbage collector: CPython's defaults (%s=0)", ENV)
        _applied = False
        return False
    _tune()
    logger.info("garbage collector: %d start-up objects frozen, young threshold %d", gc.get_freeze_count(),
                YOUNG_THRESHOLD)
    _applied = True
    return True
