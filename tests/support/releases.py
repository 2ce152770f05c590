"""Engine "releases" for tests: the stand-in (no model needed) and this very virtualenv."""
from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

STANDIN = Path(__file__).with_name("standin_engine.py")
ROOT = Path(__file__).resolve().parents[2]


def standin_release(where: Path) -> Path:
    """A release whose `python -m engine` is the stand-in; everything else is the real interpreter."""
    bin_dir = where / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    python = bin_dir / "python"
    python.write_text(
        "#!/bin/bash\n"
        f'export PYTHONPATH={ROOT}"${{PYTHONPATH:+:$PYTHONPATH}}"\n'
        f'if [ "$1" = "-m" ] && [ "$2" = "engine" ]; then shift 2; exec {sys.executable} {STANDIN} "$@"; fi\n'
        f'exec {sys.executable} "$@"\n')
    python.chmod(python.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return where


def venv_release() -> Path:
    """The test run's own environment, which has the real engine installed."""
    return Path(sys.prefix)


os.environ.setdefault("PYTHONUNBUFFERED", "1")
