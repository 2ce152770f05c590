"""Where the shipped templates/ and profiles/ live: the repo root in a checkout, tgi_hpc/_data in a wheel."""
from __future__ import annotations

from pathlib import Path

_PKG = Path(__file__).resolve().parent


def data_dir(name: str) -> Path:
    """`templates` or `profiles`: the wheel's copy if installed, else the checkout's."""
    for candidate in (_PKG / "_data" / name, _PKG.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"tgi-hpc data folder {name!r} is missing next to {_PKG}")
