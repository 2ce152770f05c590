"""Build, cache and load the engine's small C++ CPU kernels (no torch headers, called through ctypes).

Each kernel file holds its C++ source as a string; `build` compiles it once per CPU type and compiler
with g++ -O3 -march=native -fopenmp into a cache keyed by the source, the flags, the compiler and the
CPU (a shared home is safe across node types), and loads it. Plain C++ and OpenMP compile in a second or
two, where torch/extension.h costs a minute under load_inline.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import time
from pathlib import Path
from typing import Callable

logger = logging.getLogger(__name__)

FLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++20", "-shared", "-fPIC"]


def cache_dir() -> Path:
    """Where compiled kernels live: $TGI_HPC_KERNEL_CACHE, else $XDG_CACHE_HOME or ~/.cache, /tgi-hpc/kernels."""
    if os.environ.get("TGI_HPC_KERNEL_CACHE"):
        return Path(os.environ["TGI_HPC_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tgi-hpc" / "kernels"


def compiler() -> str | None:
    """The C++ compiler to build with ($CXX, else g++), None when there is none."""
    return shutil.which(os.environ.get("CXX", "g++"))


def _cpu_key() -> str:
    """The CPU -march=native compiles for: model name and feature flags (a shared cache must not mix them)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags"))}))
    except OSError:
        return platform.processor() or platform.machine()


def build(name: str, source: str, log: logging.Logger = logger, extra: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The library compiled from `source`, from the cache when it is there (`name` prefixes the file). `extra` flags
    go after FLAGS (tests build narrower vector widths than the CPU's with e.g. -mno-avx512f)."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError(f"no C++ compiler: {os.environ.get('CXX', 'g++')} is not on PATH")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256("\n".join([source, *FLAGS, *extra, version, _cpu_key()]).encode()).hexdigest()[:16]
    path = cache_dir() / f"{name}_{key}.so"
    start = time.monotonic()
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        cpp = path.with_suffix(f".{os.getpid()}.cpp")
        partial = path.with_suffix(f".{os.getpid()}.so")
        cpp.write_text(source)
        try:
            built = subprocess.run([cxx, *FLAGS, *extra, str(cpp), "-o", str(partial)], capture_output=True, text=True,
                                   timeout=300)
            if built.returncode != 0:
                raise RuntimeError(f"{cxx} failed ({built.returncode}): {built.stderr.strip()[-2000:]}")
            os.replace(partial, path)  # atomic: ranks building at once each install a whole library
        finally:
            cpp.unlink(missing_ok=True)
            partial.unlink(missing_ok=True)
        log.info("CPU kernel %s compiled in %.1f s into %s", name, time.monotonic() - start, path)
    return ctypes.CDLL(str(path))


def built_and_checked(self_check: Callable[[], str | None]) -> str | None:
    """Why a kernel library cannot serve here (None: a compiler built it and `self_check` passed): the common
    tail of the kernels' `unusable_reason`. A broken build or a raising check is a reason, not a crash."""
    if compiler() is None:
        return "no C++ compiler to build it (set CXX or put g++ on PATH)"
    try:
        return self_check()
    except Exception as error:  # a broken build must not take the engine down
        return f"self-check raised {type(error).__name__}: {error}"


def address(library: ctypes.CDLL, function: str) -> int:
    """Where `function` of a loaded library is, for C++ code that calls it by address."""
    return ctypes.cast(getattr(library, function), ctypes.c_void_p).value


class Library:
    """One kernel library: built (or found in the cache) on first use, loaded once per process, with the
    ctypes signatures of its functions set: {"fn": (restype, [argtypes...])}; `extra` compiler flags as `build`'s."""

    def __init__(self, name: str, source: str, signatures: dict[str, tuple], log: logging.Logger = logger,
                 extra: tuple[str, ...] = ()) -> None:
        self.name, self.source, self.signatures, self.log, self.extra = name, source, signatures, log, extra
        self.handle: ctypes.CDLL | None = None

    def load(self) -> ctypes.CDLL:
        if self.handle is None:
            library = build(self.name, self.source, self.log, self.extra)
            for function, (restype, argtypes) in self.signatures.items():
                getattr(library, function).restype = restype
                getattr(library, function).argtypes = argtypes
            self.handle = library
        return self.handle
