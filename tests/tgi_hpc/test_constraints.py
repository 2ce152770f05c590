"""The pinned environment: every engine dependency is pinned for releases, the two files do not overlap,
and the test venv is exactly what they pin (so an upstream release cannot change CI between commits)."""
from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import update_constraints  # noqa: E402


def _names(requirements: list[str]) -> set[str]:
    return {update_constraints.normalize(re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0]) for r in requirements}


def test_every_engine_dependency_is_pinned_for_releases():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = _names(extras["engine"] + extras["test"] + project["dependencies"]) - {"torch", "numpy"}
    pinned = set(update_constraints.read(update_constraints.RELEASE)) | set(
        update_constraints.read(update_constraints.TEST))
    assert wanted - pinned == set()
    engine_pins = set(update_constraints.read(update_constraints.RELEASE))
    assert _names(project["optional-dependencies"]["engine"]) - {"torch", "numpy"} <= engine_pins


def test_the_two_files_do_not_overlap_and_pin_exact_versions():
    release, test = (update_constraints.read(p) for p in (update_constraints.RELEASE, update_constraints.TEST))
    assert not set(release) & set(test)
    assert "torch" not in release and "numpy" not in release
    for line in (update_constraints.RELEASE.read_text() + update_constraints.TEST.read_text()).splitlines():
        assert line.startswith("#") or re.fullmatch(r"[a-z0-9-]+==[\w.+]+", line), line


def test_this_venv_is_the_pinned_environment():
    """scripts/setup.sh installs with the pins; a drifted venv is named package by package."""
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "update_constraints.py"), "--check"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_the_release_builder_collects_with_the_constraints():
    from tgi_hpc.release import builder

    assert builder.CONSTRAINTS.is_file()
    assert update_constraints.read(builder.CONSTRAINTS) == update_constraints.read(update_constraints.RELEASE)
    assert '"--constraint", str(CONSTRAINTS)' in Path(builder.__file__).read_text()
