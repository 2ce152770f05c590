"""Device kernels in Triton (and the CPU kernels in C++), each beside a plain-torch reference of the same math.

This package owns the kernels and nothing that chooses between them: the layers (and the
start-up self-checks in engine/worker.py) decide which implementation runs. Every kernel module
keeps its launcher free of GPU->CPU syncs, so the kernels can be captured in CUDA graphs.

On a machine without CUDA the kernels still run in Triton's interpreter (TRITON_INTERPRET=1,
set before the kernel modules are imported): correct in fp32/fp16, not in bf16. CI tests them so.

Modules:
- triton_attention: `unified_attention` (paged varlen attention for any mix of prefill and decode rows,
  split-KV decode with a log-sum-exp reduce when max_query_len == 1), `DecodeWorkspace` (its
  preallocated split buffers, for CUDA graphs), `decode_num_splits`, `write_kv_cache`.
- attention_reference: the same math in float64 plain torch (`paged_attention_reference`,
  `write_kv_cache_reference`).
- cpu_attention: `paged_attention` (decode rows and short spans over the paged cache in place, C++ built
  by g++ at first use and cached per CPU in ~/.cache/tgi-hpc/kernels or $TGI_HPC_KERNEL_CACHE; `load`
  builds it); its reference is attention_reference's `paged_attention_reference` too.
- cpu_log_softmax: `log_softmax` and `greedy` (argmax + its logprob in one read) over CPU float32 logits, C++ like
  cpu_attention; references `log_softmax_reference` / `greedy_reference` beside them.
- fp8_quant: `quantize_tokens`, FP8 W8A8's per-token activation quantization in one kernel (absmax, scale,
  round to e4m3), bit-equal to its torch reference (`quantize_tokens_reference`), self-checked per device.
- lora: `lora_apply`, the batched multi-LoRA update (per-token shrink and expand by adapter index);
  lora_reference: `lora_reference`, the same in float64 plain torch.
"""
from __future__ import annotations

import os


def triton_available() -> bool:
    """True when `import triton` works (it ships with CUDA and ROCm torch; a CPU install needs it added)."""
    try:
        import triton  # noqa: F401
    except Exception:  # ImportError, or a broken install raising at import
        return False
    return True


def triton_interpreted() -> bool:
    """True when @triton.jit kernels run in the CPU interpreter instead of being compiled."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
