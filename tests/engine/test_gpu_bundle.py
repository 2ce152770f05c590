"""The GPU bundle (`scripts/gpu_check.sh --prepare DIR`) is complete: installed alone into an empty target
beside this machine's torch, in an interpreter that sees only the GPU machine's packages, every engine
module and every test module the GPU check runs imports. A missing wheel fails here, not on the GPU."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_bundle  # noqa: E402


def python312() -> str | None:
    """A CPython 3.12 here, if any (pyenv keeps one on the project's machines)."""
    found = sorted(Path.home().glob(".pyenv/versions/3.12*/bin/python3.12"))
    found += sorted(Path("/usr/bin").glob("python3.12"))
    return str(found[-1]) if found else None


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-bundle")
    gpu_bundle.prepare(out)
    return out


def run_imports(bundle_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_imports.py"), "--as-machine", str(bundle_dir),
                           *extra], capture_output=True, text=True, timeout=600)


def test_the_bundle_fits_and_every_wheel_installs_on_cpython_312(bundle):
    manifest = json.loads((bundle / "manifest.json").read_text())
    size = sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file())
    assert size < 40 * 2**20
    names = [gpu_bundle.canonicalize_name(w["distribution"]) for w in manifest["wheels"]]
    assert len(names) == len(set(names)), "two versions of one distribution stop the whole install"
    assert not [w["file"] for w in manifest["wheels"] if gpu_bundle.incompatible(w)]
    # what the issue found missing on the machine, and what the engine and gpu tests import
    for needed in ("starlette", "pydantic", "pydantic-core", "llguidance", "jsonschema", "referencing", "rpds-py",
                   "jsonschema-specifications", "compressed-tensors", "loguru", "uvicorn"):
        assert needed in names
    assert not {"torch", "triton", "numpy"} & set(names), "the machine's own CUDA builds must stay"
    assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= set(manifest["tokenizer"])


def test_every_engine_and_gpu_test_module_imports_with_only_the_machine_and_the_bundle(bundle):
    py312 = python312()
    result = run_imports(bundle, *(["--py312", py312] if py312 else []))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("{")))
    assert report["failures"] == {} and report["modules"] > 100
    if py312:
        assert "3.12 ok" in result.stdout


def test_a_wheel_left_out_fails_the_import_check(bundle, tmp_path):
    partial = tmp_path / "partial"
    shutil.copytree(bundle, partial)
    for wheel in (partial / "wheels").glob("starlette-*.whl"):
        wheel.unlink()
    result = run_imports(partial, "--modules", "engine.server.app,engine.attention.metadata")
    assert result.returncode == 1
    report = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("{")))
    assert list(report["failures"]) == ["engine.server.app"]
    assert "starlette" in report["failures"]["engine.server.app"]


def test_an_import_nobody_classified_fails_the_prepare():
    machine = gpu_bundle.machine_packages()
    with pytest.raises(SystemExit, match="not_a_package_anywhere .imported by engine/x.py"):
        gpu_bundle.classify({"not_a_package_anywhere": ["engine/x.py"], "torch": ["engine/y.py"]}, machine)
    table, carry = gpu_bundle.classify({"starlette": ["a.py"], "torch": ["b.py"], "flash_attn": ["c.py"]}, machine)
    assert carry == ["starlette"] and table["torch"].startswith("on the machine")
    assert table["flash_attn"].startswith("optional")
