"""The build steps of a release (venv, wheels, install, kernels, bytecode), each run once and logged."""
from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tgi_hpc import __version__
from tgi_hpc.errors import ReleaseError
from tgi_hpc.release.kernels import (KERNEL_BUILD_DEPS, KERNEL_TIMEOUT_S, check_torch_for_kernels, find_nvcc,
                                     flash_attn_archs, max_jobs, torch_wheel_cuda)
from tgi_hpc.release.manifest import LOCK, WHEELHOUSE, Manifest, atomic_write, sha256_file
from tgi_hpc.release.spec import ReleaseSpec, inputs_hash, resolve_project

BUILD_LOG = "build.log"
STATE = ".tgi-hpc-build.json"
_PIP_TIMEOUT_S = 3600
CONSTRAINTS = Path(__file__).with_name("constraints.txt")
_NOT_FOUND_HINT = ("A package or version is not available from the index/wheelhouse pip used: check the version "
                   "(--torch-spec), or on a node without internet run the build on the login node, or pass a "
                   "wheelhouse that holds it (--offline). ")
_LOCK_HEADER = ("# tgi-hpc engine release lock (pip freeze of the release venv).\n"
                "# Recreate offline: python -m pip install --no-index --find-links wheelhouse -r requirements.lock\n")

Progress = Callable[[str], None]


def offline_pip_args(wheelhouse: Path) -> list[str]:
    """pip arguments that take every package from `wheelhouse` and nothing from the network."""
    return ["--no-index", "--find-links", str(wheelhouse)]


class ReleaseBuilder:
    """The build steps, each recorded in the state file when it finishes."""

    def __init__(self, spec: ReleaseSpec, release_dir: Path, inputs: dict[str, Any], state: dict[str, Any],
                 progress: Progress):
        self.spec, self.dir, self.inputs, self.state, self.progress = spec, release_dir, inputs, state, progress
        self.wheelhouse = release_dir / WHEELHOUSE
        self.python = str(release_dir / "bin" / "python")

    def run(self) -> Manifest:
        steps = [("venv", self.create_venv), ("wheels", self.collect_wheels), ("install", self.install)]
        if self.spec.with_kernels:
            steps += [("kernels", self.build_kernels)]
        if self.spec.compile_bytecode:
            steps += [("bytecode", self.compile_bytecode)]
        for name, step in steps:
            if name in self.state["done"]:
                self.progress(f"{name}: already done")
                continue
            self.progress(f"{name}: ...")
            step()
            self.state["done"].append(name)
            atomic_write(self.dir / STATE, json.dumps(self.state))
        return self.manifest()

    # steps
    def create_venv(self) -> None:
        flags = ["--system-site-packages"] if self.spec.system_site_packages else []
        if self.spec.venv_tool == "virtualenv":
            found = shutil.which("virtualenv")
            tool = [found] if found else [self.spec.python, "-m", "virtualenv"]
            argv = [*tool, "--no-download", "-p", self.spec.python, *flags, str(self.dir)]
        else:
            argv = [self.spec.python, "-m", "venv", *flags, str(self.dir)]
        self.run_logged(argv, "create the virtual environment", timeout=600)

    def collect_wheels(self) -> None:
        project, _, build_requires = resolve_project(self.spec)
        self.wheelhouse.mkdir(exist_ok=True)
        # the engine's dependencies at the versions the suite ran (constraints.txt), not whatever is newest today
        self.pip_wheel([project, self.spec.torch_spec], "collect the wheels of the engine",
                       extra=["--constraint", str(CONSTRAINTS)])
        if build_requires:  # so that an offline rebuild can build tgi-hpc from source again
            self.pip_wheel(build_requires, "collect the build backend of tgi-hpc")
        built = max(self.wheelhouse.glob("tgi_hpc-*.whl"), key=lambda p: p.stat().st_mtime)
        self.state["project_version"] = built.name.split("-")[1]
        if self.spec.with_kernels:  # refuse a CPU torch before installing it
            torch_wheel = max(self.wheelhouse.glob("torch-*.whl"), key=lambda p: p.stat().st_mtime)
            check_torch_for_kernels(torch_wheel_cuda(torch_wheel), f"the torch wheel {torch_wheel.name}", find_nvcc())

    def install(self) -> None:
        extras = f"[{','.join(self.spec.extras)}]" if self.spec.extras else ""
        self.pip_install([f"tgi-hpc{extras}=={self.state['project_version']}", self.spec.torch_spec],
                         "install the engine from the wheelhouse")

    def build_kernels(self) -> None:
        check_torch_for_kernels(probe_release(self.dir).get("cuda"), f"torch in {self.dir}", find_nvcc())
        archs = self.inputs["cuda_archs"]
        env = {"TORCH_CUDA_ARCH_LIST": ";".join(archs), "FLASH_ATTN_CUDA_ARCHS": ";".join(flash_attn_archs(archs)),
               "FLASH_ATTENTION_FORCE_BUILD": "TRUE", "MAX_JOBS": os.environ.get("MAX_JOBS") or str(max_jobs())}
        self.pip_wheel(KERNEL_BUILD_DEPS, "collect the kernel build tools")
        self.pip_install(KERNEL_BUILD_DEPS, "install the kernel build tools")
        self.progress(f"kernels: compiling {self.spec.kernels_spec} for {env['TORCH_CUDA_ARCH_LIST']} with "
                      f"MAX_JOBS={env['MAX_JOBS']} (this takes 20-60 minutes)")
        self.pip_wheel([self.spec.kernels_spec], "compile flash-attn", extra=["--no-build-isolation", "--no-deps"],
                       env=env, timeout=KERNEL_TIMEOUT_S)
        self.pip_install([self.spec.kernels_spec, "einops"], "install flash-attn")

    def compile_bytecode(self) -> None:
        site = json.loads(self.run_logged([self.python, "-c", "import json, sysconfig; "
                                           "print(json.dumps(sysconfig.get_paths()['purelib']))"],
                                          "find site-packages", timeout=60, capture=True))
        # -j 0: all cores; some packages ship files that do not compile (templates, py2 tests): not fatal
        self.run_logged([self.python, "-m", "compileall", "-q", "-j", "0", site], "compile bytecode",
                        timeout=_PIP_TIMEOUT_S, check=False)

    # pip
    def pip_wheel(self, reqs: list[str], what: str, *, extra: list[str] | None = None,
                  env: dict[str, str] | None = None, timeout: int = _PIP_TIMEOUT_S) -> None:
        argv = [self.python, "-m", "pip", "wheel", "--wheel-dir", str(self.wheelhouse),
                "--find-links", str(self.wheelhouse), *(extra or []), *self.spec.pip_args, *reqs]
        self.run_logged(argv, what, env=env, timeout=timeout)

    def pip_install(self, reqs: list[str], what: str) -> None:
        argv = [self.python, "-m", "pip", "install", "--no-compile", *offline_pip_args(self.wheelhouse), *reqs]
        self.run_logged(argv, what, env={"PIP_CONFIG_FILE": os.devnull}, isolated_pip=True)

    def run_logged(self, argv: list[str], what: str, *, env: dict[str, str] | None = None,
                   timeout: int = _PIP_TIMEOUT_S, check: bool = True, isolated_pip: bool = False,
                   capture: bool = False) -> str:
        """Run `argv` with its output in build.log (stdout returned instead when `capture`)."""
        full_env = _clean_env(self.dir, isolated_pip) | (env or {})
        log_path = self.dir / BUILD_LOG
        with open(log_path, "a") as log:
            log.write(f"\n$ {' '.join(argv)}\n")
            log.flush()
            start = log.tell()
            try:
                proc = subprocess.run(argv, env=full_env, stdout=subprocess.PIPE if capture else log,
                                      stderr=log if capture else subprocess.STDOUT, text=True, timeout=timeout,
                                      cwd=self.dir)
            except (OSError, subprocess.TimeoutExpired) as e:
                raise ReleaseError(f"could not {what} in {self.dir}: {e}; rerun the same command to resume") from e
        if check and proc.returncode != 0:
            output = _tail(log_path, start)
            hint = _NOT_FOUND_HINT if "No matching distribution" in output else ""
            raise ReleaseError(f"could not {what} (exit {proc.returncode}):\n{output}\n{hint}full log: {log_path}. "
                               "Fix the cause and rerun the same command: finished steps are kept")
        return proc.stdout or ""

    # manifest
    def manifest(self) -> Manifest:
        probe = probe_release(self.dir)
        wheels = {p.name: sha256_file(p) for p in sorted(self.wheelhouse.glob("*.whl"))}
        lock_text, with_hashes = self.write_lock(wheels)
        return Manifest(
            name=self.dir.name, location=str(self.dir),
            created_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            tgi_hpc_version=probe.get("tgi_hpc") or "", built_by=__version__, python=probe["python"],
            torch=probe.get("torch") or "", cuda=probe.get("cuda"), transformers=probe.get("transformers"),
            kernels={"flash_attn": probe.get("flash_attn")},
            cuda_archs=self.inputs["cuda_archs"], inputs_hash=inputs_hash(self.inputs), inputs=self.inputs,
            lock_sha256=hashlib.sha256(lock_text.encode()).hexdigest(), lock_hashes=with_hashes, wheelhouse=wheels)

    def write_lock(self, wheels: dict[str, str]) -> tuple[str, bool]:
        frozen = self.run_logged([self.python, "-m", "pip", "freeze"], "list the installed packages",
                                 timeout=300, isolated_pip=True, capture=True)
        pins = sorted((line.strip() for line in frozen.splitlines() if "==" in line), key=str.lower)
        by_pin = {_pin_key(*_wheel_name_version(name)): sha for name, sha in wheels.items()}
        hashes = [by_pin.get(_pin_key(*pin.split("==", 1))) for pin in pins]
        with_hashes = all(hashes) and bool(pins)
        lines = [f"{pin} \\\n    --hash=sha256:{sha}" if with_hashes else pin for pin, sha in zip(pins, hashes)]
        text = _LOCK_HEADER + "\n".join(lines) + "\n"
        atomic_write(self.dir / LOCK, text)
        return text, with_hashes


def probe_release(release_dir: Path, *, timeout: int = 300) -> dict[str, Any]:
    """Versions inside the release, asked of its own python (see tgi_hpc.release.selftest's `probe`)."""
    python = Path(release_dir) / "bin" / "python"
    argv = [str(python), "-I", "-m", "tgi_hpc.release.selftest", "probe"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=_clean_env(release_dir, False))
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError) as e:
        raise ReleaseError(f"the release python {python} could not report its versions (exit {proc.returncode}):\n"
                           f"{proc.stderr[-2000:]}") from e


def _clean_env(release_dir: Path, isolated_pip: bool) -> dict[str, str]:
    """No PYTHONPATH leaks into the release; its bin/ first on PATH (torch's extension builder looks for
    ninja there); pip's cache next to the releases, not in a small $HOME."""
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"}}
    env["PATH"] = os.pathsep.join([str(Path(release_dir) / "bin"), env.get("PATH", os.defpath)])
    if isolated_pip:
        env = {k: v for k, v in env.items() if not k.startswith("PIP_") or k in {"PIP_CACHE_DIR", "PIP_NO_CACHE_DIR"}}
    env.setdefault("PIP_CACHE_DIR", str(Path(release_dir).parent / ".cache" / "pip"))
    env["PYTHONNOUSERSITE"] = "1"
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _wheel_name_version(filename: str) -> tuple[str, str]:
    name, version = filename.split("-")[:2]
    return name, version


def _pin_key(name: str, version: str) -> tuple[str, str]:
    return re.sub(r"[-_.]+", "-", name).lower(), version.strip()


def _tail(path: Path, start: int, lines: int = 25) -> str:
    """The last lines one command wrote to the log, without pip's noise about unusable index folders."""
    with open(path, "rb") as f:
        f.seek(start)
        text = f.read().decode(errors="replace").splitlines()
    keep = [line for line in text if "is ignored: it is neither a file nor a directory" not in line]
    return "\n".join(keep[-lines:])
