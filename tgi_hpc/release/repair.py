"""Repair what a copy breaks in a release (python links, exec bits, moved paths), and detect those breaks.

Stdlib only: the release's own python imports this module (through tgi_hpc.release.verify).
"""
from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Any

from tgi_hpc.release.manifest import read_manifest, write_manifest


def fix_permissions(release_dir: Path) -> list[Path]:
    """Give back the exec bit (where a read bit is) to bin/* and shared libraries; returns what changed."""
    fixed = missing_exec_bits(Path(release_dir), libraries=True)
    for path in fixed:
        mode = path.stat().st_mode
        path.chmod(mode | ((mode & 0o444) >> 2))
    return fixed


def relocate_release(release_dir: Path) -> list[Path]:
    """Point a moved release's bin/ scripts, activate files and pyvenv.cfg at where it is now."""
    root = Path(release_dir).resolve()
    manifest = read_manifest(root)
    old = recorded_location(root, manifest)
    if old is None or old == str(root):
        return []
    changed = []
    for path in [*sorted((root / "bin").iterdir()), root / "pyvenv.cfg"]:
        if path.is_symlink() or not path.is_file() or path.stat().st_size > 1 << 20:
            continue
        data = path.read_bytes()
        if old.encode() in data:
            path.write_bytes(_relocated(data, old.encode(), str(root).encode()))
            changed.append(path)
    if manifest is not None:
        manifest.location = str(root)
        write_manifest(root, manifest)
    return changed


def _relocated(data: bytes, old: bytes, new: bytes) -> bytes:
    first, sep, rest = data.partition(b"\n")
    if not first.startswith(b"#!" + old + b"/"):
        return data.replace(old, new)
    interpreter = new + first[2 + len(old):]
    if b" " in interpreter or len(interpreter) > 125:
        # the kernel splits a shebang at spaces and cuts it at 127 bytes: let sh exec python, as pip does
        first = b"#!/bin/sh\n'''exec' \"" + interpreter + b"\" \"$0\" \"$@\"\n' '''"
    else:
        first = b"#!" + interpreter
    return first + sep + rest.replace(old, new)


def restore_python_links(release_dir: Path) -> list[Path]:
    """Recreate bin/python* from pyvenv.cfg when a copy dropped the symlinks (Globus does not copy them)."""
    root = Path(release_dir)
    cfg = pyvenv_cfg(root)
    version = ".".join(cfg.get("version", cfg.get("version_info", "")).split(".")[:2])
    base = Path(cfg.get("home", "/nonexistent")) / f"python{version}"
    target = base if base.exists() else Path(cfg.get("executable", base))
    made = []
    for name, link in ((f"python{version}", target), ("python3", Path(f"python{version}")),
                       ("python", Path(f"python{version}"))):
        path = root / "bin" / name
        if version and not path.exists() and not path.is_symlink():
            path.symlink_to(link)
            made.append(path)
    return made


def repair_release(release_dir: Path) -> list[Path]:
    """What `--fix` does: python links back, exec bits back, then the paths of a moved release rewritten."""
    return restore_python_links(release_dir) + fix_permissions(release_dir) + relocate_release(release_dir)


# --- what a copy breaks ----------------------------------------------------------------------------------

def recorded_location(root: Path, manifest: Any) -> str | None:
    """Where the release was built: the manifest's location, else the path venv wrote into bin/activate."""
    if manifest is not None:
        return manifest.location
    try:  # no manifest: the path venv wrote into bin/activate
        activate = (root / "bin" / "activate").read_text()
        m = re.search(r"^\s*(?:export\s+)?VIRTUAL_ENV=[\"']?([^\"'\n$]+)", activate, re.M)
    except OSError:
        return None
    return m[1] if m else None


def pyvenv_cfg(root: Path) -> dict[str, str]:
    """The key = value lines of the release's pyvenv.cfg ({} when it cannot be read)."""
    try:
        lines = (root / "pyvenv.cfg").read_text().splitlines()
    except OSError:
        return {}
    return {k.strip(): v.strip() for k, _, v in (line.partition("=") for line in lines) if v}


def missing_exec_bits(root: Path, *, libraries: bool = False) -> list[Path]:
    """Programs (a #! script or an ELF binary in a bin/ folder) without their exec bit; with `libraries`,
    shared libraries too (they load without it, but Globus strips it from them as well)."""
    missing = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in {"wheelhouse", "__pycache__", ".cache"}]
        in_bin = os.path.basename(dirpath) == "bin"
        for name in filenames:
            is_library = name.endswith(".so") or ".so." in name
            if not (in_bin or (libraries and is_library)):
                continue
            path = Path(dirpath, name)
            st = path.lstat()
            if not stat.S_ISREG(st.st_mode) or st.st_mode & stat.S_IXUSR:
                continue
            if (libraries and is_library) or _is_program(path):
                missing.append(path)
    return sorted(missing)


def _is_program(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return False
    return head.startswith(b"#!") or head == b"\x7fELF"
