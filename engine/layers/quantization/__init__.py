"""Quantized checkpoints: which linear method each linear layer uses, and how it loads and runs.

Owns: reading the checkpoint's `quantization_config` or `--quantize` into ONE QuantizationConfig
(`config.resolve`), the LinearMethod interface (`base`: create weights, load a tensor-parallel shard,
apply), one file per format (unquantized, gptq, awq, compressed_tensors, fp8, bitsandbytes) and the
packed-int4/int8 method they share (`wna16`). Model files never see formats: `LinearBase` asks
`current_method()` for its method while the model is built inside `building(config)`.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from engine.layers.quantization.base import LinearMethod, QuantizationConfig, QuantizationError
from engine.layers.quantization.config import SUPPORTED, resolve

__all__ = ["SUPPORTED", "LinearMethod", "QuantizationConfig", "QuantizationError", "building",
           "current_method", "resolve"]

_current: QuantizationConfig | None = None


@contextmanager
def building(config: QuantizationConfig | None) -> Iterator[None]:
    """Linear layers created inside use `config`'s linear method (None = unquantized)."""
    global _current
    previous, _current = _current, config
    try:
        yield
    finally:
        _current = previous


def current_method() -> LinearMethod:
    from engine.layers.quantization.unquantized import UnquantizedLinearMethod

    return _current.linear_method() if _current is not None else UnquantizedLinearMethod()
