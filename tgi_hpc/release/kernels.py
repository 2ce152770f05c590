"""Compiled attention kernels for a release: CUDA architectures, nvcc, and the torch they must match.

Stdlib only: the release's own python imports this module (through tgi_hpc.release.selftest) before torch.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import zipfile
from pathlib import Path

from tgi_hpc.errors import ReleaseError

KERNELS_SPEC = "flash-attn"
KERNEL_BUILD_DEPS = ["ninja", "packaging", "psutil", "setuptools", "wheel", "einops"]
# Ampere, Ada, Hopper: the GPUs of Mila and DRAC; flash-attn 2 has no kernels below sm_80.
DEFAULT_CUDA_ARCHS = ["8.0", "8.6", "8.9", "9.0"]
KERNEL_TIMEOUT_S = 4 * 3600


def parse_cuda_archs(value: str | list[str]) -> list[str]:
    """'8.0,9.0', '80;90', 'sm_86 9.0a' -> ['8.0', '9.0', ...] (TORCH_CUDA_ARCH_LIST spelling)."""
    items = value if isinstance(value, list) else re.split(r"[,;\s]+", value)
    archs = []
    for item in (i.strip() for i in items if i.strip()):
        m = re.fullmatch(r"(?:sm_|compute_)?(\d{1,2})\.?(\d)([af]?)(\+PTX)?", item, re.IGNORECASE)
        if not m:
            raise ReleaseError(f"bad CUDA architecture {item!r}: use compute capabilities like 8.0, 8.6, 9.0 "
                               "(A100 = 8.0, A6000/A10 = 8.6, L40S = 8.9, H100 = 9.0)")
        arch = f"{int(m[1])}.{m[2]}{m[3].lower()}{'+PTX' if m[4] else ''}"
        if arch not in archs:
            archs.append(arch)
    return archs


def flash_attn_archs(archs: list[str]) -> list[str]:
    """flash-attn builds one cubin per major (sm_80 also runs on 8.6/8.9); it has none below 8.0."""
    majors = sorted({int(a.split(".")[0]) for a in archs})
    return [f"{m}0" for m in majors if m >= 8]


def find_nvcc() -> str:
    """The CUDA compiler flash-attn needs, from PATH or $CUDA_HOME/bin; ReleaseError when there is none."""
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    nvcc = shutil.which("nvcc") or (cuda_home and shutil.which("nvcc", path=str(Path(cuda_home) / "bin")))
    if not nvcc:
        raise ReleaseError("--with-kernels needs the CUDA compiler, and nvcc is neither on PATH nor in "
                           "$CUDA_HOME/bin: load the CUDA toolkit matching torch's CUDA first (Mila: "
                           "`module load cuda/12.x`; DRAC: `module load cuda`), or build without --with-kernels "
                           "(the engine then uses PyTorch SDPA attention)")
    return nvcc


def check_torch_for_kernels(torch_cuda: str | None, torch_label: str, nvcc: str) -> None:
    """Kernels compile only against a CUDA torch, with an nvcc of the same CUDA major version."""
    if not torch_cuda:
        raise ReleaseError(f"--with-kernels needs a CUDA build of torch, but {torch_label} is a CPU build "
                           "(torch.version.cuda is None): pin a CUDA wheel (DRAC wheelhouse: torch==2.x is a CUDA "
                           "build; PyPI: --extra-index-url https://download.pytorch.org/whl/cu126) or drop "
                           "--with-kernels")
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    m = re.search(r"release (\d+)\.(\d+)", out)
    if m and m[1] != torch_cuda.split(".")[0]:
        raise ReleaseError(f"nvcc ({nvcc}) is CUDA {m[1]}.{m[2]} but {torch_label} was built for CUDA {torch_cuda}: "
                           f"load a CUDA {torch_cuda.split('.')[0]}.x toolkit module so that the kernels match torch")


def torch_wheel_cuda(wheel: Path) -> str | None:
    """torch.version.cuda of a torch wheel, read from its torch/version.py without installing it."""
    with zipfile.ZipFile(wheel) as z:
        return parse_torch_cuda(z.read("torch/version.py").decode())


def parse_torch_cuda(version_py: str) -> str | None:
    """The `cuda = '12.4'` (or None) line of torch/version.py."""
    m = re.search(r"^cuda(?:\s*:[^=]*)?\s*=\s*(?:None|['\"]([^'\"]*)['\"])", version_py, re.M)
    return m[1] if m and m[1] else None


def max_jobs() -> int:
    """nvcc jobs: one per core, but flash-attn needs ~4 GB per job."""
    cores = len(os.sched_getaffinity(0))
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3
    slurm_mem = os.environ.get("SLURM_MEM_PER_NODE")
    if slurm_mem and slurm_mem.isdigit():
        mem_gb = min(mem_gb, int(slurm_mem) / 1024)
    return max(1, min(cores, int(mem_gb // 4)))
