"""Copies between the host and the device that never wait for the work already queued on the device: a step's
small inputs on their way in, its picks and prompt logprobs on their way out.

A copy to a GPU from pageable host memory (`tensor.to("cuda")`, `torch.tensor(..., device="cuda")`, with or
without non_blocking) may make the host wait until the kernels queued on the stream have finished: the driver
stages pageable memory in stream order. When step N+1 is prepared while N runs (engine/async_scheduling.py) that
wait is the whole of N. Staged through pinned memory and copied non_blocking, the host runs on; torch's caching
host allocator keeps each pinned source until its copy's event has passed, so the source may go out of scope.
Off CUDA a copy is a plain `to` (on CPU, none at all). The way out is the mirror image: `to_host` copies into pinned
memory non_blocking, and the caller waits on the event `copies_done` records after its copies before reading them.
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


def to_host(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """A CUDA tensor's copy in pinned host memory, started, not waited for (read it after `copies_done`'s event);
    off CUDA the tensor itself, already readable."""
    if tensor is None or tensor.device.type != "cuda":
        return tensor
    return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True).copy_(tensor, non_blocking=True)


def copies_done(device: torch.device) -> torch.cuda.Event | None:
    """An event recorded on `device`'s current stream after the copies queued so far (`to_host`); None off CUDA,
    where nothing was queued."""
    if device.type != "cuda":
        return None
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(device))
    return done
