"""Builds of a C++ CPU kernel for CPUs with narrower vector registers than this one (AVX-512 -> AVX2 -> SSE): the
kernels' tiles follow the register width (engine/kernels/cpu_simd.py's fnv), and a narrower build runs here too, so
every width's code is checked on any x86 machine, not only on the CPU type CI happens to get."""
import platform
from pathlib import Path

from engine.kernels.cpp_build import Library


def narrower_than_here() -> list[tuple[str, ...]]:
    """The extra compiler flags of each width below this CPU's own (its own is what the other tests build)."""
    if platform.machine() != "x86_64":
        return []
    flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("flags")), [])
    return ([("-mno-avx512f",)] if "avx512f" in flags else []) + ([("-mno-avx",)] if "avx" in flags else [])


def narrower_build(kernel_module, extra: tuple[str, ...]) -> Library:
    """`kernel_module`'s library (its SOURCE and signatures) built with `extra` flags: monkeypatch it over the
    module's `_LIBRARY` and the module's own functions run the narrower build."""
    library = kernel_module._LIBRARY
    return Library(f"{library.name}_narrow", kernel_module.SOURCE, library.signatures, extra=extra)
