"""The vector widths a C++ CPU kernel is tested at here: the kernels' register tiles follow the target's vector
(engine/kernels/cpu_simd.py's fnv: 16 floats with AVX-512, else 8), so on a CPU with AVX-512 a second build without
it runs too, and both tilings are checked wherever the suite runs, not only on the CPU type CI happens to get."""
import platform
from pathlib import Path

from engine.kernels.cpp_build import Library


def widths_here() -> list[tuple[str, ...]]:
    """Extra compiler flags of each build to test: () is the CPU's own; ("-mno-avx512f",) where it has AVX-512."""
    if platform.machine() != "x86_64":
        return [()]
    flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("flags")), [])
    return [()] + ([("-mno-avx512f",)] if "avx512f" in flags else [])


def build_for(kernel_module, extra: tuple[str, ...]) -> Library:
    """`kernel_module`'s library built with `extra` flags (its own library for none): monkeypatch it over the
    module's `_LIBRARY` and the module's functions run that build."""
    library = kernel_module._LIBRARY
    if not extra:
        return library
    return Library(f"{library.name}_narrow", kernel_module.SOURCE, library.signatures, extra=extra)
