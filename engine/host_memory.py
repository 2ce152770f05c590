"""How much memory this process may use on a CPU node, and the KV-cache budget sized from it.

The limit is the smallest of what applies: the cgroup's (Slurm's task/cgroup plugin puts every job in one,
and so do containers), Slurm's own job memory (`SLURM_MEM_PER_NODE`, or `SLURM_MEM_PER_CPU` times the CPUs
on the node), and the machine's memory. Memory other processes hold counts too: the budget never exceeds
what the kernel says is available now (`MemAvailable`).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

# The KV cache takes this share of the memory left once the model is loaded; the rest is activations,
# the tokenizer, HTTP and the allocator's slack. vLLM-CPU's default KV space is a fixed 4 GiB;
# a share follows the node (a 24 GiB laptop, a 2 TiB cluster node).
KV_SHARE = 0.5
MIN_KV_BYTES = 16 << 20
_MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class MemoryLimit:
    limit: int          # bytes this process (its job, its cgroup) may use in all
    source: str         # where the limit comes from, for the log
    available: int      # bytes the kernel could give now (MemAvailable, or the limit less what the cgroup uses)


def memory_limit(environ: dict[str, str] | None = None, proc: Path = Path("/proc"),
                 cgroup_root: Path = Path("/sys/fs/cgroup")) -> MemoryLimit:
    environ = os.environ if environ is None else environ
    meminfo = _meminfo(proc / "meminfo")
    candidates = [(meminfo.get("MemTotal", 0), "the machine's memory")]
    available = meminfo.get("MemAvailable", meminfo.get("MemTotal", 0))
    cgroup = _cgroup_limit(proc / "self" / "cgroup", cgroup_root)
    if cgroup is not None:
        limit, used, where = cgroup
        candidates.append((limit, f"the cgroup limit ({where})"))
        available = min(available, max(limit - used, 0))
    slurm = _slurm_limit(environ)
    if slurm is not None:
        candidates.append(slurm)
    limit, source = min((c for c in candidates if c[0] > 0), default=(0, "nothing known"))
    return MemoryLimit(limit, source, min(available, limit) if limit else available)


def cpu_kv_budget(bytes_per_token: int, max_tokens: int, local_ranks: int = 1,
                  memory: MemoryLimit | None = None, fraction: float = 1.0) -> int:
    """Bytes for one rank's KV cache: its share of `KV_SHARE` of the memory available now (the model is
    loaded, so its weights are already out of it), never more than `max_tokens` tokens need. `fraction`: this
    engine's part of the node when several engines share it (`--cuda-memory-fraction`, which the offline batch's
    `--workers N` sets to 1/N), so that together they stay within `KV_SHARE`."""
    memory = memory or memory_limit()
    share = int(memory.available * KV_SHARE * fraction / max(local_ranks, 1))
    needed = bytes_per_token * max_tokens
    budget = min(max(share, MIN_KV_BYTES), needed)
    logger.info("KV cache sized from the machine: %d MiB of the %d MiB available (limit %d MiB, from %s; "
                "share %.0f%% over %d rank(s); the most the engine can hold is %d MiB); --kv-cache-bytes overrides",
                budget // _MIB, memory.available // _MIB, memory.limit // _MIB, memory.source,
                KV_SHARE * fraction * 100, local_ranks, needed // _MIB)
    return budget


def _meminfo(path: Path) -> dict[str, int]:
    values = {}
    try:
        for line in path.read_text().splitlines():
            name, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                values[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except OSError:
        pass
    return values


def _cgroup_limit(self_cgroup: Path, root: Path) -> tuple[int, int, str] | None:
    """(limit, usage, path) of the innermost memory limit over this process's cgroup and its parents."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return None
    best = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2: memory.max up the tree
            folders, names = [root / path.lstrip("/")], ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            folders, names = [root / "memory" / path.lstrip("/")], ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        while folders[-1] != folders[-1].parent and root in folders[-1].parents:
            folders.append(folders[-1].parent)
        for folder in folders:
            limit, usage = _read_int(folder / names[0]), _read_int(folder / names[1])
            # v1 says "no limit" with a page-rounded 2**63
            if limit is not None and limit < 1 << 60 and (best is None or limit < best[0]):
                best = (limit, usage or 0, str(folder))
    return best


def _slurm_limit(environ) -> tuple[int, str] | None:
    if environ.get("SLURM_MEM_PER_NODE", "").isdigit() and int(environ["SLURM_MEM_PER_NODE"]) > 0:
        return int(environ["SLURM_MEM_PER_NODE"]) * _MIB, "SLURM_MEM_PER_NODE"
    per_cpu, cpus = environ.get("SLURM_MEM_PER_CPU", ""), environ.get("SLURM_CPUS_ON_NODE", "")
    if per_cpu.isdigit() and cpus.isdigit() and int(per_cpu) > 0:
        return int(per_cpu) * int(cpus) * _MIB, "SLURM_MEM_PER_CPU x SLURM_CPUS_ON_NODE"
    return None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
