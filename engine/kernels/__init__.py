"""Device kernels written in Triton, each beside a plain-torch reference of the same math.

This package owns the kernels and nothing that chooses between them: the layers (and the
start-up self-checks in engine/worker.py) decide which implementation runs. Every kernel module
keeps its launcher free of GPU->CPU syncs, so the kernels can be captured in CUDA graphs.

On a machine without CUDA the kernels still run in Triton's interpreter (TRITON_INTERPRET=1,
set before the kernel modules are imported): correct in fp32/fp16, not in bf16. CI tests them so.
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
