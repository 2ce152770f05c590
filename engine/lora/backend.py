"""How the LoRA update runs: the Triton kernels on CUDA, grouped torch matmuls elsewhere; chosen once at start.

Both add, for every token, `B_i (A_i x)` of its adapter i to the layer's output. The grouped path runs two
matmuls per adapter present in the step; the worker orders a step's spans by adapter
(engine/lora/batch.py `order_by_adapter`), so each adapter's tokens are one slice and a whole batch costs a
few small GEMMs per layer whatever its mix. The Triton path is one launch pair per layer; on prefill-sized steps,
where per-token programs lose to tensor-core GEMMs, it hands over to the grouped path.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from engine.kernels import triton_available
from engine.lora.batch import LoraBatch

logger = logging.getLogger(__name__)

Apply = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, LoraBatch], torch.Tensor]
GROUPED_FROM_TOKENS = 256   # Triton backend: steps with more tokens use the grouped GEMMs


def grouped_apply(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                  batch: LoraBatch) -> torch.Tensor:
    """y[rows_i] += (x[rows_i] A_i^T) B_i^T for each adapter i in the step; y is updated in place."""
    for index, rows in batch.groups:
        h = x[rows] @ a[index].T
        if isinstance(rows, slice):  # the usual case: the worker orders spans by adapter
            y[rows].addmm_(h, b[index].T)
        else:
            y.index_add_(0, rows, h @ b[index].T)
    return y


def triton_apply(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                 batch: LoraBatch) -> torch.Tensor:
    if batch.num_tokens >= GROUPED_FROM_TOKENS:
        return grouped_apply(x, y, a, b, batch)
    from engine.kernels.lora import lora_apply

    return lora_apply(x, y, a, b, batch.token_indices)


BACKENDS: dict[str, Apply] = {"triton": triton_apply, "grouped": grouped_apply}


def masked_apply(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                 token_indices: torch.Tensor) -> torch.Tensor:
    """y += (x A_i^T) B_i^T for every adapter slot i over every token, zeroed where the token is not i's: the same
    launches whatever the map, so a CUDA graph can hold it (piecewise graphs on the grouped backend)."""
    for i in range(a.shape[0]):
        mask = (token_indices == i + 1).to(x.dtype)[:, None]
        y.addmm_((x @ a[i].T) * mask, b[i].T)
    return y


def indexed_apply(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                  token_indices: torch.Tensor) -> torch.Tensor:
    """The Triton kernels on the map alone (no grouped hand-over: its slices are Python-side)."""
    from engine.kernels.lora import lora_apply

    return lora_apply(x, y, a, b, token_indices)


# inside piecewise graphs: (x, y, a, b, token_indices) -> y
GRAPH_BACKENDS: dict[str, Callable] = {"triton": indexed_apply, "grouped": masked_apply}


def choose(device: torch.device, dtype: torch.dtype, agree: Callable[[bool], bool] = lambda ok: ok,
           ) -> tuple[str, dict[str, str]]:
    """The backend every rank uses, and the verdict on each candidate ("ok" or why not)."""
    report: dict[str, str] = {}
    candidates = ["triton", "grouped"] if device.type == "cuda" else ["grouped"]
    if device.type != "cuda":
        report["triton"] = "needs CUDA"
    for name in candidates:
        verdict = "ok"
        if name == "triton" and not triton_available():
            verdict = "triton is not installed"
        elif (error := self_check(BACKENDS[name], device, dtype)) is not None:
            verdict = error
        if agree(verdict == "ok"):
            report[name] = "ok"
            return name, report
        report[name] = verdict if verdict != "ok" else "another rank failed its check"
    raise RuntimeError(f"no LoRA backend passed its self-check: {report}")


def self_check(apply: Apply, device: torch.device, dtype: torch.dtype) -> str | None:
    """None when `apply` matches the float64 reference on a random mixed batch, else what went wrong."""
    from engine.batch import SeqSpan
    from engine.kernels.lora_reference import lora_reference

    gen = torch.Generator().manual_seed(0)
    lengths, adapters = [3, 1, 5, 1, 2], [2, 0, 1, 2, 3]
    spans = [SeqSpan(i, [0] * n, 0, [], adapter=k) for i, (n, k) in enumerate(zip(lengths, adapters))]
    x = torch.randn(sum(lengths), 96, generator=gen).to(device, dtype)
    y = torch.randn(sum(lengths), 80, generator=gen).to(device, dtype)
    a = (torch.randn(3, 24, 96, generator=gen) / 10).to(device, dtype)
    b = (torch.randn(3, 80, 24, generator=gen) / 10).to(device, dtype)
    batch = LoraBatch()
    batch.set(spans, device)
    expected = lora_reference(x, y, a, b, batch.token_indices)
    try:
        got = apply(x, y.clone(), a, b, batch)
    except Exception as exc:  # noqa: BLE001 - any failure means "not this backend"
        return f"failed: {type(exc).__name__}: {exc}"
    error = (got.double() - expected).abs().max().item()
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    return None if error <= tolerance else f"max error {error:.2e} above {tolerance}"
