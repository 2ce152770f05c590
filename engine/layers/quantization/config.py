"""Choose the quantization: the checkpoint's `quantization_config` (GPTQ, AWQ, compressed-tensors) or the
`--quantize` flag for formats made at load (fp8, bitsandbytes*). Everything else fails here, before any
weight is read, with one line naming the format and what is supported."""
from __future__ import annotations

from typing import Any

from engine.layers.quantization.base import QuantizationConfig, QuantizationError

FROM_CHECKPOINT = ("gptq", "awq", "compressed-tensors")
AT_LOAD = ("fp8", "bitsandbytes", "bitsandbytes-nf4", "bitsandbytes-fp4")
SUPPORTED = FROM_CHECKPOINT + AT_LOAD
SUPPORTED_LINE = ("supported: GPTQ (int4/int8), AWQ (gemm, int4) and compressed-tensors (W4A16/W8A16 "
                  "pack-quantized, FP8 W8A8) checkpoints, and --quantize fp8, bitsandbytes, bitsandbytes-nf4, "
                  "bitsandbytes-fp4 on a float checkpoint")


def resolve(checkpoint: dict[str, Any] | None, flag: str | None) -> QuantizationConfig | None:
    """The quantization to serve with (None = plain float weights)."""
    flag = (flag or "none").lower()
    method = str(checkpoint.get("quant_method", "")).lower() if checkpoint else None
    if flag not in ("none", *SUPPORTED):
        raise QuantizationError(f"--quantize {flag} is not supported; {SUPPORTED_LINE}")
    if method is None:
        if flag in FROM_CHECKPOINT:
            raise QuantizationError(f"--quantize {flag} needs a {flag} checkpoint, and this one has no "
                                    "quantization_config; use --quantize fp8 or bitsandbytes* to quantize a "
                                    "float checkpoint at load")
        return _at_load(flag) if flag != "none" else None
    if method not in FROM_CHECKPOINT:
        raise QuantizationError(f"the checkpoint is quantized with {method or 'an unnamed method'!r}, which this "
                                f"engine cannot serve; {SUPPORTED_LINE}")
    if flag not in ("none", method):
        raise QuantizationError(f"--quantize {flag} does not apply to this {method} checkpoint; drop the flag "
                                f"(the checkpoint's quantization_config is used) or pass --quantize {method}")
    _refuse_exceptions(method, checkpoint)
    return _from_checkpoint(method, checkpoint)


def _from_checkpoint(method: str, raw: dict[str, Any]) -> QuantizationConfig:
    if method == "gptq":
        from engine.layers.quantization.gptq import GPTQConfig
        return GPTQConfig(raw)
    if method == "awq":
        from engine.layers.quantization.awq import AWQConfig
        return AWQConfig(raw)
    from engine.layers.quantization.compressed_tensors import CompressedTensorsConfig
    return CompressedTensorsConfig(raw)


def _at_load(flag: str) -> QuantizationConfig:
    if flag == "fp8":
        from engine.layers.quantization.fp8 import Fp8Config
        return Fp8Config()
    from engine.layers.quantization.bitsandbytes import BitsAndBytesConfig
    return BitsAndBytesConfig(flag)


def _refuse_exceptions(method: str, raw: dict[str, Any]) -> None:
    """Per-module exceptions (left in float, other bits) would need a method per layer; refuse them."""
    skipped = [m for m in raw.get("modules_to_not_convert") or [] if m != "lm_head"]
    if skipped or raw.get("dynamic"):
        what = f"modules_to_not_convert {skipped}" if skipped else "per-module `dynamic` overrides"
        raise QuantizationError(f"{method} checkpoint with {what} is not supported: every decoder linear layer "
                                "must use the same quantization")
