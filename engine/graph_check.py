"""The start-up check a graph path of the forward passes before any step uses it (engine/cuda_graphs.py,
engine/piecewise_graphs.py): a probe step through it and through the eager forward, on the same cache scribbled
with finite values, must agree; otherwise, or when the probe raises, the engine runs those steps eagerly.

Under tensor parallelism a probe that raises is not survivable: its peers are inside the probe's collectives
(and a capture records them without running them), so a rank that gave up would pair its next collective with a
peer's different one. It raises, and the runner's watchdog ends the other ranks (engine/model_runner.py)."""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from engine import distributed

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
        if distributed.tp_size() > 1:
            raise
        logger.warning("%s failed their self-check (%s): %s", what, error, fallback)
        return False
    error = (eager - graphed).abs().max().item()
    if not error <= tolerance * (1.0 + eager.abs().max().item()):
        logger.warning("%s disagree with the eager forward (max error %.3g): %s", what, error, fallback)
        return False
    return True


def uncapturable(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the model's forward cannot be captured in a CUDA graph at all (a layer reads device values on the host),
    or None. A capture of such a forward fails every time, and a failed capture is not free (torch's allocator is
    left mid-capture), so it is not tried."""
    from engine.layers import fused_moe
    from engine.layers.quantization.bitsandbytes import BitsAndBytesLinearMethod

    if any(isinstance(m, fused_moe.FusedMoE) for m in model.modules()) and \
            fused_moe.choose_backend(device, dtype) == "torch":
        return "the MoE layers run on torch's path, which reads the experts' group sizes on the host"
    if any(isinstance(getattr(m, "method", None), BitsAndBytesLinearMethod) and m.method.mode == "int8"
           for m in model.modules()):
        return "bitsandbytes int8 layers find their outlier columns on the host"
    return None


def end_capture_pool(device: torch.device, pool: tuple[int, int]) -> None:
    """After a capture that failed: take torch's allocator out of capture mode for `pool` (a failed
    `cudaStreamEndCapture` skips that), else it defers every cross-stream free for the rest of the process."""
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if end is not None:
        try:
            end(device.index if device.index is not None else torch.cuda.current_device(), pool)
        except Exception:  # noqa: BLE001 - best effort; the pool was never entered when capture_begin failed
            logger.debug("ending the failed capture's pool raised", exc_info=True)
