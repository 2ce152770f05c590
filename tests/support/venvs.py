"""Fresh venvs with a non-editable tgi-hpc, offline: the wheel is built from this checkout and installed with
--no-deps; the dependencies come from this test run's site-packages, added after the venv's own."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def pip(*args: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    subprocess.run([sys.executable, "-m", "pip", "-q", *args], check=True, env=env, timeout=300,
                   capture_output=True)


def fresh_venv(where: Path) -> Path:
    """A venv without pip whose sys.path ends with this test run's site-packages (the engine's dependencies,
    offline), after its own: a plain path line in a .pth adds the folder without running its .pth files, so the
    shared venv's editable tgi-hpc stays out. Returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=120)
    site = next(where.glob("lib/python3*/site-packages"))
    shared = next(p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir())
    (site / "shared-venv.pth").write_text(shared + "\n")
    return where / "bin" / "python"


def wheel_venv(source: Path, where: Path) -> tuple[Path, Path]:
    """(python, wheel): `source` built into a wheel under `where`, installed non-editable into a fresh venv."""
    wheels = where / "wheels"
    pip("wheel", "--no-deps", "-w", str(wheels), str(source))
    wheel = next(wheels.glob("tgi_hpc-*.whl"))
    python = fresh_venv(where / "venv")
    pip("--python", str(python), "install", "--no-deps", "--no-index", str(wheel))
    return python, wheel
