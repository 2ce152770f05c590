"""`compile` installs the engine from where this tgi-hpc came from (PEP 610 direct_url.json): a wheel, a
directory, a VCS URL at its commit, an archive URL, else the published version. The end-to-end part installs
the CLI non-editable into fresh venvs (offline: --no-deps, the shared venv's packages on sys.path)."""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from support.venvs import fresh_venv, pip
from tgi_hpc import __version__
from tgi_hpc.errors import ReleaseError
from tgi_hpc.release import spec as spec_mod
from tgi_hpc.release.origin import Origin, parse_direct_url
from tgi_hpc.release.spec import OWN_BUILD_REQUIRES, ReleaseSpec, resolve_project

ROOT = Path(__file__).resolve().parents[2]


def test_each_pep610_form():
    assert parse_direct_url(None) == Origin("index") == parse_direct_url(" \n")
    vcs = {"url": "https://github.com/org/tgi-hpc.git", "vcs_info": {"vcs": "git", "commit_id": "0a1b2c",
                                                                      "requested_revision": "main"}}
    assert parse_direct_url(json.dumps(vcs)) == Origin("vcs", "git+https://github.com/org/tgi-hpc.git@0a1b2c")
    vcs["subdirectory"] = "pkg"
    assert parse_direct_url(json.dumps(vcs)).url.endswith("@0a1b2c#subdirectory=pkg")
    wheel = {"url": "file:///opt/my%20wheels/tgi_hpc-0.1.0-py3-none-any.whl", "archive_info": {"hash": "sha256=ab"}}
    assert parse_direct_url(json.dumps(wheel)) == Origin("wheel", path=Path("/opt/my wheels/tgi_hpc-0.1.0-py3-none-any.whl"))
    assert parse_direct_url('{"url": "file:///src/tgi-hpc", "dir_info": {}}') == Origin("dir", path=Path("/src/tgi-hpc"))
    assert parse_direct_url('{"url": "file:///src/x", "dir_info": {"editable": true}}').kind == "dir"
    remote = '{"url": "https://example.org/tgi_hpc-0.1.0.tar.gz", "archive_info": {}}'
    assert parse_direct_url(remote) == Origin("archive", "https://example.org/tgi_hpc-0.1.0.tar.gz")


@pytest.mark.parametrize("text", ["{", "[]", '{"url": 3}', '{"vcs_info": {}}', '{"url": "https://h/x", "dir_info": {}}'])
def test_a_broken_record_is_a_release_error_naming_the_file(text):
    with pytest.raises(ReleaseError, match="direct_url.json"):
        parse_direct_url(text, "/site/tgi_hpc-0.1.0.dist-info/direct_url.json")


@pytest.fixture
def installed(monkeypatch):
    """resolve_project as in an installed tgi-hpc: no checkout beside it, this origin."""
    monkeypatch.setattr(spec_mod, "_checkout_root", lambda: None)
    return lambda origin: monkeypatch.setattr(spec_mod, "installed_origin", lambda: origin)


def test_resolve_follows_the_origin(installed, tmp_path):
    spec = ReleaseSpec(release_dir=tmp_path)
    installed(Origin("index"))
    assert resolve_project(spec) == (f"tgi-hpc[engine]=={__version__}", f"pypi:{__version__}", [])
    installed(Origin("vcs", "git+https://github.com/org/tgi-hpc.git@0a1b2c"))
    req, ident, build = resolve_project(spec)
    assert req == "tgi-hpc[engine] @ git+https://github.com/org/tgi-hpc.git@0a1b2c"
    assert ident == "vcs:git+https://github.com/org/tgi-hpc.git@0a1b2c" and build == list(OWN_BUILD_REQUIRES)
    installed(Origin("wheel", path=tmp_path / "gone.whl"))
    with pytest.raises(ReleaseError, match="gone.whl, which is gone"):
        resolve_project(spec)


def test_own_build_requires_are_pyprojects():
    import re

    found = re.search(r"^\[build-system\]\nrequires = (\[.*\])$", (ROOT / "pyproject.toml").read_text(), re.M)
    assert found and list(OWN_BUILD_REQUIRES) == json.loads(found.group(1))


def test_a_release_of_another_version_is_a_warning(tmp_path, caplog):
    from tgi_hpc.slurm.cluster import open_cluster
    from tgi_hpc.workflows.checks import check_release

    release = tmp_path / "rel; $(x)"
    (release / "bin").mkdir(parents=True)
    (release / "bin" / "python").symlink_to(sys.executable)
    cluster = open_cluster("local", [f"paths.jobs={tmp_path / 'jobs'}"])
    for version, warned in ((__version__, False), ("0.0.9", True), ("", False)):
        (release / "release.json").write_text(json.dumps({"tgi_hpc_version": version}))
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            check_release(cluster, str(release), explicit=True)
        assert (f"holds tgi-hpc 0.0.9, this CLI is {__version__}: rebuild it with `tgi-hpc compile`"
                in caplog.text) is warned


# --- end to end: fresh venvs, non-editable installs -----------------------------------------------------

def _resolve_in(python: Path, cwd: Path) -> tuple[str, str, list[str]]:
    code = ("import json, tgi_hpc; from pathlib import Path; from tgi_hpc.release.spec import ReleaseSpec, "
            "resolve_project; print(json.dumps([tgi_hpc.__file__, resolve_project(ReleaseSpec(Path('.')))]))")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    out = subprocess.run([str(python), "-c", code], check=True, capture_output=True, text=True, cwd=cwd,
                         env=env, timeout=60).stdout
    where, resolved = json.loads(out)
    assert where.startswith(str(python.parents[1])), f"tgi_hpc imported from {where}, not the fresh venv"
    return tuple(resolved)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A snapshot of this checkout, in a folder whose name needs quoting."""
    snapshot = tmp_path_factory.mktemp("src") / "tgi hpc src"
    snapshot.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, snapshot / name)
    for name in ("tgi_hpc", "engine", "templates", "profiles"):
        shutil.copytree(ROOT / name, snapshot / name, ignore=shutil.ignore_patterns("__pycache__"))
    return snapshot


@pytest.mark.slow
def test_wheel_and_directory_installs_compile_from_themselves(source, tmp_path):
    wheels = tmp_path / "wheels"
    pip("wheel", "--no-deps", "-w", str(wheels), str(source))
    wheel = next(wheels.glob("tgi_hpc-*.whl"))

    from_wheel = fresh_venv(tmp_path / "v1")
    pip("--python", str(from_wheel), "install", "--no-deps", "--no-index", str(wheel))
    req, ident, _ = _resolve_in(from_wheel, tmp_path)
    assert req == f"tgi-hpc[engine] @ {wheel.as_uri()}" and ident.startswith("wheel:")

    from_dir = fresh_venv(tmp_path / "v2")
    pip("--python", str(from_dir), "install", "--no-deps", str(source))       # built, not editable
    req_dir, ident_dir, build = _resolve_in(from_dir, tmp_path)
    assert req_dir == f"tgi-hpc[engine] @ {source.as_uri()}" and ident_dir.startswith("source:")
    assert build == list(OWN_BUILD_REQUIRES)

    # what the release build then installs: the engine, from that same wheel (not PyPI's tgi-hpc)
    target = tmp_path / "release site"
    pip("install", "--no-deps", "--no-index", "--target", str(target), req)
    assert (target / "engine" / "__init__.py").is_file() and (target / "tgi_hpc" / "release" / "origin.py").is_file()
