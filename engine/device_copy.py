"""Host-to-device copies of a step's small inputs that never wait for the work already queued on the device.

A copy to a GPU from pageable host memory (`tensor.to("cuda")`, `torch.tensor(..., device="cuda")`, with or
without non_blocking) may make the host wait until the kernels queued on the stream have finished: the driver
stages pageable memory in stream order. When step N+1 is prepared while N runs (engine/async_scheduling.py) that
wait is the whole of N. Staged through pinned memory and copied non_blocking, the host runs on; torch's caching
host allocator keeps each pinned source until its copy's event has passed, so the source may go out of scope.
Off CUDA a copy is a plain `to` (on CPU, none at all).
"""
from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, its copy queued, not waited for."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def list_to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A short host list as a tensor on `device`, as `to_device`."""
    return to_device(torch.tensor(values, dtype=dtype), device)
