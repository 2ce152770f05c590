"""tgi_hpc.release.build and tgi_hpc.release.verify: one real CPU release per module, reused by every slow test.

The release holds torch==2.13.0 (CPU) and the engine; building it takes ~40 s, the offline rebuild
from its wheelhouse another ~40 s. Bytecode compilation is skipped to save time (the step is one
compileall call).
"""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from tgi_hpc.errors import ReleaseError
from tgi_hpc.release.build import CURRENT, build_release
from tgi_hpc.release.builder import offline_pip_args
from tgi_hpc.release.kernels import (check_torch_for_kernels, find_nvcc, flash_attn_archs, parse_cuda_archs,
                                     torch_wheel_cuda)
from tgi_hpc.release.manifest import LOCK, MANIFEST, WHEELHOUSE, Manifest, read_manifest, sha256_file
from tgi_hpc.release.repair import fix_permissions, repair_release
from tgi_hpc.release.selftest import gpu_problems
from tgi_hpc.release.spec import ReleaseSpec, release_name
from tgi_hpc.release.verify import verify_release



@dataclass
class Built:
    spec: ReleaseSpec
    manifest: Manifest
    messages: list[str]
    seconds: float

    @property
    def dir(self) -> Path:
        return self.spec.release_dir / self.spec.name


def _offline_env(mp: pytest.MonkeyPatch) -> None:
    """No pip config, no PIP_* variables: the wheelhouse passed on the command line is the only source."""
    for key in [k for k in os.environ if k.startswith("PIP_")]:
        mp.delenv(key)
    mp.setenv("PIP_CONFIG_FILE", os.devnull)


def _shell(script: str, cwd: Path) -> str:
    """Like a job script: a fresh bash, away from this checkout (python -c puts the cwd on sys.path)."""
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "VIRTUAL_ENV"}}
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, check=True,
                          timeout=120, cwd=cwd).stdout.strip()


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A snapshot of this checkout: the shared tree changes under a running test, a release must not."""
    root, snapshot = Path(__file__).resolve().parents[2], tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(root / name, snapshot / name)
    for name in ("tgi_hpc", "engine", "templates", "profiles"):
        shutil.copytree(root / name, snapshot / name, ignore=shutil.ignore_patterns("__pycache__"))
    return snapshot


@pytest.fixture(scope="module")
def releases(tmp_path_factory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("releases")
    yield root
    shutil.rmtree(root, ignore_errors=True)  # ~2.5 GB: do not wait for pytest's rotation


@pytest.fixture(scope="module")
def built(releases, source) -> Built:
    spec = ReleaseSpec(release_dir=releases, name="r1", compile_bytecode=False, project_source=source)
    messages: list[str] = []
    start = time.monotonic()
    manifest = build_release(spec, progress=messages.append)
    return Built(spec, manifest, messages, time.monotonic() - start)


@pytest.fixture(scope="module")
def rebuilt(built, releases) -> Built:
    """A second release built from the first one's wheelhouse alone (tgi-hpc again from source, so the
    wheelhouse must also hold its build backend)."""
    spec = replace(built.spec, name="r2", pip_args=offline_pip_args(built.dir / WHEELHOUSE))
    messages: list[str] = []
    start = time.monotonic()
    with pytest.MonkeyPatch.context() as mp:
        _offline_env(mp)
        manifest = build_release(spec, progress=messages.append)
    return Built(spec, manifest, messages, time.monotonic() - start)


def _project_wheel(built: Built) -> Path:
    """tgi-hpc as a wheel: builds that fail early need not build it from source again."""
    return next((built.dir / WHEELHOUSE).glob("tgi_hpc-*.whl"))


def _pins(release_dir: Path) -> list[str]:
    return [line.split(" ")[0] for line in (release_dir / LOCK).read_text().splitlines()
            if line and not line.startswith(("#", " "))]


# --- a complete release -------------------------------------------------------------------------------

@pytest.mark.slow
def test_build_makes_a_complete_self_contained_release(built, releases):
    root, m = built.dir, built.manifest
    assert (root / "bin" / "activate").is_file() and (root / "bin" / "python").exists()
    assert (root / "pyvenv.cfg").read_text().count("include-system-site-packages = false") == 1
    assert os.readlink(releases / CURRENT) == "r1"  # relative, so RELEASES can move as a whole
    assert read_manifest(root) == m
    assert m.torch == "2.13.0+cpu" and m.cuda is None and m.kernels == {"flash_attn": None}
    assert m.transformers and m.python.startswith("3.") and m.tgi_hpc_version == "0.1.0"
    assert m.location == str(root) and m.lock_sha256 == sha256_file(root / LOCK)
    pins = _pins(root)
    assert "torch==2.13.0+cpu" in pins and "tgi-hpc==0.1.0" in pins
    assert any(p.startswith("transformers==") for p in pins)
    assert m.lock_hashes and (root / LOCK).read_text().count("--hash=sha256:") == len(pins)
    torch_wheel = next(name for name in m.wheelhouse if name.startswith("torch-"))
    assert m.wheelhouse[torch_wheel] == sha256_file(root / WHEELHOUSE / torch_wheel)
    assert not (root / ".tgi-hpc-build.json").exists()


@pytest.mark.slow
def test_activate_selects_the_release_engine(built):
    out = _shell(f"source {built.dir}/bin/activate && python -c 'import sys, engine; print(sys.prefix); "
                 "print(engine.__file__)'", cwd=built.dir.parent)
    prefix, engine_file = out.splitlines()
    assert prefix == str(built.dir) and engine_file.startswith(str(built.dir / "lib"))


@pytest.mark.slow
def test_same_spec_again_rebuilds_nothing(built):
    before = (built.dir / MANIFEST).stat().st_mtime_ns
    messages: list[str] = []
    start = time.monotonic()
    assert build_release(built.spec, progress=messages.append) == built.manifest
    assert time.monotonic() - start < 15
    assert any("up to date" in msg for msg in messages)
    assert (built.dir / MANIFEST).stat().st_mtime_ns == before


@pytest.mark.slow
def test_other_inputs_into_a_complete_release_are_refused(built):
    with pytest.raises(ReleaseError, match=r"different inputs \(changed: torch_spec\).*leave out --name"):
        build_release(replace(built.spec, torch_spec="torch==2.12.0"), progress=lambda _: None)


@pytest.mark.slow
def test_a_release_is_not_taken_for_the_releases_folder(built):
    with pytest.raises(ReleaseError, match=r"is a release itself.*pass .* with --name r1"):
        build_release(replace(built.spec, release_dir=built.dir, name=None), progress=lambda _: None)


@pytest.mark.slow
def test_default_name_builds_next_to_the_others(built, releases):
    """Without a name the release lands in RELEASES/<release_name>; the same spec twice is one release."""
    spec = replace(built.spec, name=None)
    (releases / release_name(spec)).symlink_to("r1")  # stands in for a finished build of the same spec
    try:
        messages: list[str] = []
        assert build_release(spec, progress=messages.append) == built.manifest
        assert any("up to date" in m for m in messages)
    finally:
        (releases / release_name(spec)).unlink()


@pytest.mark.slow
def test_verify_generates_with_the_release_engine(built):
    report = verify_release(built.dir.parent / CURRENT, gpu=False)
    assert report.ok, report.format()
    assert report.details["cpu_generation"]["tokens"] == 8
    assert report.details["torch"] == "2.13.0+cpu" and report.details["prefix"] == str(built.dir)


# --- repairs ------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_fix_permissions_restores_what_globus_drops(built):
    site = next((built.dir / "lib").glob("python3*/site-packages"))
    stripped = sorted([built.dir / "bin" / "tgi-hpc", site / "torch" / "bin" / "torch_shm_manager",
                       next((site / "torch" / "lib").glob("libtorch_cpu.so"))])
    data_file = next(p for p in (site / "torch" / "bin").iterdir() if p.suffix in {".pt", ".ptl"})
    for path in stripped:
        path.chmod(path.stat().st_mode & ~0o111)
    report = verify_release(built.dir, run_engine=False)
    assert not report.ok and any("executable bit" in p and "--fix" in p for p in report.problems)
    assert fix_permissions(built.dir) == stripped
    assert all(p.stat().st_mode & 0o111 == 0o111 for p in stripped)
    assert not data_file.stat().st_mode & stat.S_IXUSR  # data in a bin/ folder stays data
    assert verify_release(built.dir, run_engine=False).ok
    assert fix_permissions(built.dir) == []


# --- offline rebuild and a moved release -----------------------------------------------------------------

@pytest.mark.slow
def test_offline_rebuild_from_the_wheelhouse_alone(built, rebuilt, releases):
    assert _pins(rebuilt.dir) == _pins(built.dir)
    assert rebuilt.manifest.torch == built.manifest.torch and rebuilt.manifest.inputs == built.manifest.inputs
    torch_wheel = next(name for name in built.manifest.wheelhouse if name.startswith("torch-"))
    assert rebuilt.manifest.wheelhouse[torch_wheel] == built.manifest.wheelhouse[torch_wheel]
    assert os.readlink(releases / CURRENT) == "r2"  # the newest complete release


@pytest.mark.slow
def test_moved_release_is_detected_and_fixed(rebuilt, releases):
    moved = releases / "moved r2"
    rebuilt.dir.rename(moved)
    python_links = sorted((moved / "bin").glob("python*"))
    for link in python_links:  # as a Globus copy leaves it
        link.unlink()
    report = verify_release(moved, run_engine=False)
    assert not report.ok
    assert any(f"built at {rebuilt.dir}" in p and f"tgi-hpc release verify --fix {moved}" in p
               for p in report.problems), report.problems
    assert any("bin/python is missing" in p for p in report.problems), report.problems
    changed = repair_release(moved)
    assert set(python_links) < set(changed)
    assert moved / "bin" / "activate" in changed and moved / "bin" / "pip" in changed
    assert verify_release(moved, run_engine=False).ok
    assert read_manifest(moved).location == str(moved)
    out = _shell(f"source '{moved}/bin/activate' && python -c 'import sys; print(sys.prefix)' && pip --version",
                 cwd=releases)
    assert out.splitlines()[0] == str(moved) and f"{moved}/lib" in out.splitlines()[1]


# --- refusals and interrupted builds ------------------------------------------------------------------------

@pytest.mark.slow
def test_failed_build_resumes_and_never_becomes_current(built, releases):
    current = os.readlink(releases / CURRENT)
    spec = replace(built.spec, name="r3", torch_spec="torch==0.0.1",
                   project_source=_project_wheel(built), pip_args=offline_pip_args(built.dir / WHEELHOUSE))
    messages: list[str] = []
    with pytest.MonkeyPatch.context() as mp:
        _offline_env(mp)
        for _ in range(2):
            with pytest.raises(ReleaseError, match=r"(?s)could not collect the wheels.*No matching distribution "
                                                   r"found for torch==0\.0\.1.*rerun the same command"):
                build_release(spec, progress=messages.append)
    assert "venv: already done" in messages and any(m.startswith("resuming the build") for m in messages)
    assert read_manifest(releases / "r3") is None and os.readlink(releases / CURRENT) == current
    report = verify_release(releases / "r3", run_engine=False)
    assert not report.ok and "incomplete (no release.json)" in report.problems[0]


@pytest.mark.slow
def test_kernels_refuse_a_cpu_torch_before_installing_it(built, releases, tmp_path, monkeypatch):
    fake_cuda = tmp_path / "cuda" / "bin"
    fake_cuda.mkdir(parents=True)
    (fake_cuda / "nvcc").write_text("#!/bin/sh\necho 'Cuda compilation tools, release 12.4, V12.4.131'\n")
    (fake_cuda / "nvcc").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake_cuda}:{os.environ['PATH']}")
    _offline_env(monkeypatch)
    spec = replace(built.spec, name="r4", with_kernels=True, cuda_archs=["8.0", "9.0"],
                   project_source=_project_wheel(built), pip_args=offline_pip_args(built.dir / WHEELHOUSE))
    with pytest.raises(ReleaseError, match=r"needs a CUDA build of torch.*torch-2\.13\.0\+cpu.*CPU build"):
        build_release(spec, progress=lambda _: None)
    assert not list((releases / "r4" / "lib").glob("python3*/site-packages/torch"))
    torch_wheel = next((built.dir / WHEELHOUSE).glob("torch-*.whl"))
    assert torch_wheel_cuda(torch_wheel) is None


def test_kernels_without_nvcc_are_refused_before_anything(tmp_path, monkeypatch, source):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    for var in ("CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(var, raising=False)
    spec = ReleaseSpec(release_dir=tmp_path / "releases", with_kernels=True, project_source=source)
    with pytest.raises(ReleaseError, match=r"nvcc is neither on PATH nor in \$CUDA_HOME/bin.*module load cuda"):
        build_release(spec, progress=lambda _: None)
    assert not spec.release_dir.exists()  # nothing created


def test_nvcc_must_match_torch_cuda_major(tmp_path, monkeypatch):
    (tmp_path / "nvcc").write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.88'\n")
    (tmp_path / "nvcc").chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    nvcc = find_nvcc()
    check_torch_for_kernels("13.0", "torch", nvcc)
    with pytest.raises(ReleaseError, match=r"nvcc .* is CUDA 13\.0 but torch was built for CUDA 12\.6.*12\.x"):
        check_torch_for_kernels("12.6", "torch", nvcc)


def test_a_foreign_directory_is_not_built_over(tmp_path, source):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("keep me")
    with pytest.raises(ReleaseError, match="not empty and is not a tgi-hpc release"):
        build_release(ReleaseSpec(release_dir=tmp_path, name="mine", project_source=source), progress=lambda _: None)
    assert (tmp_path / "mine" / "thesis.tex").read_text() == "keep me"


@pytest.mark.parametrize("name", ["current", "../escape", ".hidden", "a b"])
def test_bad_release_names_are_refused(tmp_path, source, name):
    with pytest.raises(ReleaseError, match="bad release name"):
        build_release(ReleaseSpec(release_dir=tmp_path, name=name, project_source=source), progress=lambda _: None)
    assert list(tmp_path.iterdir()) == []


def test_verify_names_the_command_for_a_missing_release(tmp_path):
    report = verify_release(tmp_path / "current")
    assert not report.ok and f"tgi-hpc compile --release-dir {tmp_path}`" in report.problems[0]


@pytest.mark.gpu
def test_verify_on_a_gpu_node(request):
    """Wherever CUDA is (the suite's `gpu` marker): the release built here (pip resolves torch==2.13.0 to a
    CUDA build on a GPU node), or TGI_HPC_TEST_RELEASE=RELEASES/current to verify one built elsewhere.
    Never skipped there: a release without a working GPU fails with what to change."""
    release = os.environ.get("TGI_HPC_TEST_RELEASE")
    release = Path(release) if release else request.getfixturevalue("built").dir
    report = verify_release(release, gpu=True)
    assert report.ok, report.format()
    assert report.details["gpu_generation"]["tokens"] == 8


def test_gpu_problems_say_what_to_change():
    cpu = gpu_problems({"cuda": None, "torch": "2.13.0+cpu"}, has_gpu=False)
    assert len(cpu) == 1 and "CPU build" in cpu[0] and "CUDA torch" in cpu[0]
    blind = gpu_problems({"cuda": "12.6", "torch": "2.13.0"}, has_gpu=False)
    assert len(blind) == 1 and "sees no GPU" in blind[0] and "nvidia-smi" in blind[0]


# --- small parts ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, expected", [
    ("8.0,9.0", ["8.0", "9.0"]),
    ("80;86 90", ["8.0", "8.6", "9.0"]),
    ("sm_89, 9.0a, 9.0+PTX", ["8.9", "9.0a", "9.0+PTX"]),
    (["8.0", "8.0"], ["8.0"]),
    ("", []),
])
def test_parse_cuda_archs(value, expected):
    assert parse_cuda_archs(value) == expected


def test_bad_cuda_arch_names_the_expected_form():
    with pytest.raises(ReleaseError, match=r"bad CUDA architecture 'ampere'.*8\.0"):
        parse_cuda_archs("8.0,ampere")


def test_flash_attn_builds_one_cubin_per_major_from_sm80():
    assert flash_attn_archs(["7.0", "8.0", "8.6", "8.9", "9.0a"]) == ["80", "90"]


def test_release_name_follows_the_inputs(tmp_path, source):
    source = shutil.copytree(source, tmp_path / "source")
    spec = ReleaseSpec(release_dir=tmp_path / "x", project_source=source)
    name = release_name(spec)
    assert name.startswith("tgi-hpc-0.1.0-py3") and "-torch2.13.0-" in name
    assert release_name(replace(spec, release_dir=tmp_path / "y", name="z", pip_args=["--no-index"])) == name
    assert release_name(replace(spec, torch_spec="torch==2.12.0")) != name
    assert release_name(replace(spec, with_kernels=True)) != name
    (source / "engine" / "__init__.py").write_text("# a code change is a new release\n")
    assert release_name(spec) != name


def test_wheel_cuda_is_read_from_version_py(tmp_path):
    import zipfile
    wheel = tmp_path / "torch-2.6.0-cp311-cp311-linux_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("torch/version.py", "from typing import Optional\n__version__ = '2.6.0'\n"
                                       "cuda: Optional[str] = '12.4'\n")
    assert torch_wheel_cuda(wheel) == "12.4"


def test_fix_permissions_on_a_copied_tree(tmp_path):
    (tmp_path / "bin").mkdir()
    script, notes, lib = tmp_path / "bin" / "tool", tmp_path / "bin" / "README", tmp_path / "libx.so.1"
    script.write_text("#!/bin/sh\necho hi\n")
    notes.write_text("not a program\n")
    lib.write_bytes(b"\x7fELF")
    for path in (script, notes, lib):
        path.chmod(0o644)
    (tmp_path / "bin" / "python").symlink_to(shutil.which("sh"))
    assert fix_permissions(tmp_path) == sorted([script, lib])
    assert stat.S_IMODE(script.stat().st_mode) == 0o755 and stat.S_IMODE(notes.stat().st_mode) == 0o644
