"""The bytes a rank may give its KV cache on a GPU: alone on it, or sharing it with other engines
(`--cuda-memory-fraction` < 1, as `tgi-hpc serve --model A --model B` does on fewer GPUs than models)."""
from __future__ import annotations

# The CUDA context and libraries' workspaces: memory this process holds that torch does not count.
CUDA_CONTEXT_BYTES = 512 << 20


def kv_budget(total: int, free: int, peak: int, current: int, reserved: int, fraction: float,
              utilization: float) -> float:
    """After a warm-up at the largest prefill: `peak`/`current` allocated and `reserved` by torch here, `free` of
    `total` on the device. Alone (fraction 1) everything in use on the GPU counts, other processes' memory too.
    Sharing (fraction < 1) the other engines' memory is theirs: this engine fills its own share, less what it
    holds itself, but never more than is free now (they may load while we measure)."""
    share = total * fraction * utilization
    if fraction >= 1:
        return share - (total - free) - peak + current
    own = share - CUDA_CONTEXT_BYTES - reserved - peak + current
    return min(own, free - total * fraction * (1 - utilization))
