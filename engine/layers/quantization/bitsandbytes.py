"""`--quantize bitsandbytes` (LLM.int8, outlier threshold 6.0 as transformers' load_in_8bit) and
`bitsandbytes-nf4` / `bitsandbytes-fp4` (4-bit, blocks of 64), quantized at load by the
`bitsandbytes` package, which also runs the matmuls.

A layer's float weight is staged on the CPU while its pieces (q/k/v, gate/up) arrive and is quantized
and moved to the device as soon as its last piece is in, so the device never holds the float model.
bitsandbytes 0.46+ runs on CUDA and CPU (0.50 checked here: 4-bit and int8 on CPU); a device or version
it cannot serve is refused at start by a self-check naming the package.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.layers.quantization.base import Layout, LinearMethod, QuantizationConfig, QuantizationError, add_param
from engine.layers.quantization.base import read_piece, store

MODES = {"bitsandbytes": "int8", "bitsandbytes-nf4": "nf4", "bitsandbytes-fp4": "fp4"}
BLOCKSIZE = 64
INT8_THRESHOLD = 6.0


def _bnb() -> Any:
    try:
        import bitsandbytes
    except Exception as error:  # ImportError, or a build that fails at import for this machine
        raise QuantizationError(f"--quantize bitsandbytes needs the `bitsandbytes` package, which cannot be "
                                f"imported here ({type(error).__name__}: {error}); pip install bitsandbytes, "
                                "or use --quantize fp8 / a GPTQ, AWQ or compressed-tensors checkpoint") from None
    return bitsandbytes


class BitsAndBytesLinearMethod(LinearMethod):
    def __init__(self, mode: str) -> None:
        self.mode = mode

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int) -> None:
        layer.bnb_device = torch.empty(0).device  # the device the model is being built on
        layer.bnb_rows_loaded = 0
        layer.bnb_state = None
        staging = torch.empty(output_size, input_size, device="cpu")
        add_param(layer, "weight", staging, self._loader(layer))

    def _loader(self, layer: nn.Module):
        def load(param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
            tensor, offset = read_piece(layer, Layout(out_axis=0, in_axis=1), loaded, shard_id, "weight")
            store(param, tensor.to(param.dtype), 0, offset, "weight")
            layer.bnb_rows_loaded += tensor.shape[0]
            if layer.bnb_rows_loaded >= layer.output_size:  # the last piece: quantize now, free the staging copy
                self._quantize(layer)
        return load

    def finish_loading(self, layer: nn.Module) -> None:
        if layer.bnb_state is None:  # dummy weights: nothing went through the loader
            self._quantize(layer)

    def _quantize(self, layer: nn.Module) -> None:
        weight = layer.weight.data.to(layer.bnb_device)
        layer.bnb_state = quantize(self.mode, weight)
        layer.weight.data = weight.new_empty(0)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return matmul(self.mode, layer.bnb_state, x, bias)


def quantize(mode: str, weight: torch.Tensor) -> Any:
    bnb = _bnb()
    if mode == "int8":
        linear = bnb.nn.Linear8bitLt(weight.shape[1], weight.shape[0], bias=False, has_fp16_weights=False,
                                     threshold=INT8_THRESHOLD, device="cpu")
        linear.weight = bnb.nn.Int8Params(weight.cpu(), requires_grad=False, has_fp16_weights=False)
        return linear.to(weight.device)  # Int8Params quantizes when moved
    packed, state = bnb.functional.quantize_4bit(weight, blocksize=BLOCKSIZE, quant_type=mode)
    return packed, state


def matmul(mode: str, state: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    bnb = _bnb()
    if mode == "int8":
        y = state(x)
        return y if bias is None else y + bias
    packed, quant_state = state
    return bnb.matmul_4bit(x, packed.t(), quant_state=quant_state, bias=bias)


class BitsAndBytesConfig(QuantizationConfig):
    def __init__(self, name: str) -> None:
        self.name, self.mode = name, MODES[name]

    def check_device(self, device: torch.device, dtype: torch.dtype) -> None:
        """Quantize and multiply a small matrix on `device`; anything bitsandbytes cannot do there fails now,
        in one line naming the package, instead of at the first request."""
        bnb = _bnb()
        try:
            generator = torch.Generator().manual_seed(0)
            weight = torch.randn(64, 128, generator=generator).to(device, dtype)
            x = torch.randn(3, 128, generator=generator).to(device, dtype)
            got = matmul(self.mode, quantize(self.mode, weight), x, None).float()
            want = (x @ weight.t()).float()
        except Exception as error:
            raise QuantizationError(f"--quantize {self.name}: bitsandbytes {bnb.__version__} cannot run on "
                                    f"{device} in {dtype} ({type(error).__name__}: {str(error).splitlines()[0]}); "
                                    "bitsandbytes >= 0.46 supports CUDA and CPU") from None
        if not torch.isfinite(got).all() or (got - want).norm() > 0.2 * want.norm():  # nf4 errs ~10%
            raise QuantizationError(f"--quantize {self.name}: bitsandbytes {bnb.__version__} gives wrong results "
                                    f"on {device} in {dtype}; refusing to serve garbage")

    def linear_method(self) -> BitsAndBytesLinearMethod:
        return BitsAndBytesLinearMethod(self.mode)

    def __repr__(self) -> str:
        return f"bitsandbytes({self.mode})"
