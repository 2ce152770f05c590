"""Quantized checkpoints as the toolkit sees them: which formats the engine serves, which one a stored
snapshot uses, whether `serve --quantize` fits it, and how many bits a linear weight then takes (the
catalog sizes jobs by weight bytes).

The lists are data here because tgi_hpc never imports the engine; tests/tgi_hpc/test_quantization.py
keeps them equal to engine.layers.quantization.config and checks the refusals against its `resolve`.
"""
from __future__ import annotations

from typing import Any

from tgi_hpc.errors import UsageError

FROM_CHECKPOINT = ("gptq", "awq", "compressed-tensors")   # read from the checkpoint's quantization_config
AT_LOAD = ("fp8", "bitsandbytes", "bitsandbytes-nf4", "bitsandbytes-fp4")  # --quantize a float checkpoint
SUPPORTED = FROM_CHECKPOINT + AT_LOAD
LEGACY_FILE = "quantize_config.json"   # older AutoGPTQ exports keep GPTQ's settings beside config.json

# Bits per weight of the formats made at load: fp8 keeps one fp32 scale per output row (negligible),
# LLM.int8 likewise; bitsandbytes 4-bit adds one fp32 absmax per block of 64 (the engine's BLOCKSIZE).
_AT_LOAD_BITS = {"fp8": 8.0, "bitsandbytes": 8.0, "bitsandbytes-nf4": 4.5, "bitsandbytes-fp4": 4.5}


def supported_line() -> str:
    return ("supported: " + ", ".join(FROM_CHECKPOINT) + " (read from the checkpoint's quantization_config), "
            + ", ".join(AT_LOAD) + " (quantize a float checkpoint at load)")


def with_legacy_config(config: dict[str, Any], legacy: dict[str, Any] | None) -> dict[str, Any]:
    """config.json with quantize_config.json folded in as the engine does: only when config.json has none."""
    if legacy is None or config.get("quantization_config"):
        return config
    return {**config, "quantization_config": {"quant_method": "gptq", **legacy}}


def checkpoint_quantization(config: dict[str, Any]) -> dict[str, Any] | None:
    found = config.get("quantization_config") or config.get("compression_config")
    return found if isinstance(found, dict) else None


def check_quantize(flag: str | None, config: dict[str, Any] | None) -> str | None:
    """The `--quantize` value to pass to the engine (None: no flag), or UsageError where the engine would
    refuse to start. `config` is the snapshot's config.json (with `with_legacy_config`), None when unread:
    then only the value itself can be checked."""
    flag = (flag or "none").lower()
    if flag not in ("none", *SUPPORTED):
        raise UsageError(f"--quantize {flag} is not supported; {supported_line()}")
    if config is None:
        return None if flag == "none" else flag
    checkpoint = checkpoint_quantization(config)
    if checkpoint is None:
        if flag in FROM_CHECKPOINT:
            raise UsageError(f"--quantize {flag} needs a {flag} checkpoint, and this one has no quantization_config "
                             f"(nor {LEGACY_FILE}); use --quantize fp8 or bitsandbytes* to quantize a float checkpoint "
                             "at load")
        return None if flag == "none" else flag
    method = str(checkpoint.get("quant_method", "")).lower()
    if method not in FROM_CHECKPOINT:
        raise UsageError(f"the checkpoint is quantized with {method or 'an unnamed method'!r}, which the engine "
                         f"cannot serve; {supported_line()}")
    if flag not in ("none", method):
        raise UsageError(f"--quantize {flag} contradicts this {method} checkpoint (its quantization_config); drop "
                         f"the flag (the checkpoint's own quantization is used) or pass --quantize {method}")
    return None if flag == "none" else flag


def linear_weight_bits(config: dict[str, Any] | None, flag: str | None) -> float:
    """Bits one linear-layer weight takes when served, scales and zero points included (16: not quantized)."""
    checkpoint = checkpoint_quantization(config) if config else None
    if checkpoint is not None:
        return _checkpoint_bits(checkpoint)
    return _AT_LOAD_BITS.get((flag or "none").lower(), 16.0)


def _checkpoint_bits(raw: dict[str, Any]) -> float:
    method = str(raw.get("quant_method", "")).lower()
    try:
        if method == "gptq":
            return _int_bits(int(raw.get("bits", 4)), int(raw.get("group_size", 128)), zeros=True)
        if method == "awq":
            return _int_bits(int(raw.get("bits", raw.get("w_bit", 4))),
                             int(raw.get("group_size", raw.get("q_group_size", 128))), zeros=True)
        if method == "compressed-tensors":
            weights = next(iter((raw.get("config_groups") or {}).values()), {}).get("weights") or {}
            bits = int(weights.get("num_bits", 16))
            if weights.get("type") == "float":
                return float(bits)
            group = int(weights.get("group_size") or -1) if weights.get("strategy") == "group" else -1
            return _int_bits(bits, group, zeros=not weights.get("symmetric", True))
    except (TypeError, ValueError, AttributeError):
        pass
    return 16.0   # unknown or malformed: size it as float weights (the engine refuses it at start anyway)


def _int_bits(bits: int, group_size: int, zeros: bool) -> float:
    """Packed ints plus one fp16 scale (and a packed zero point) per group of inputs; -1 = one per row."""
    if group_size <= 0:
        return float(bits)
    return bits + (16 + (bits if zeros else 0)) / group_size
