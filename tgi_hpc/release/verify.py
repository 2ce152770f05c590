"""Verify an engine release from outside: complete, in place, executable, able to generate.

`verify_release` runs on the login node or in a job. The engine checks run in a subprocess with the
release's own python (`python -I -m tgi_hpc.release.selftest check`), so they test exactly what a serve
job gets. Repairs (`--fix`) live in tgi_hpc.release.repair.
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tgi_hpc.errors import ReleaseError
from tgi_hpc.release.manifest import LOCK, WHEELHOUSE, read_manifest, sha256_file
from tgi_hpc.release.repair import missing_exec_bits, pyvenv_cfg, recorded_location
from tgi_hpc.release.spec import COMPILE_COMMAND

FIX_COMMAND = "tgi-hpc release verify --fix"
_CHECK_TIMEOUT_S = 900


@dataclass
class VerifyReport:
    """ok is True when `problems` is empty; each problem says what to run to fix it."""

    release_dir: Path
    ok: bool
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)

    def format(self) -> str:
        lines = [f"release {self.release_dir}: {'OK' if self.ok else 'BROKEN'}"]
        lines += [f"  {k}: {v}" for k, v in self.details.items()]
        lines += [f"  problem: {p}" for p in self.problems]
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def verify_release(release_dir: Path, *, gpu: bool | None = None, run_engine: bool = True,
                   timeout: int = _CHECK_TIMEOUT_S) -> VerifyReport:
    """Check the release at `release_dir` (a release or RELEASES/current).

    gpu: True = a GPU must work, False = CPU checks only, None = check the GPU if torch sees one.
    run_engine=False skips the subprocess (import + tiny generation): the file checks only.
    """
    path = Path(release_dir).expanduser()
    if not path.exists():
        return VerifyReport(path, False, [f"no release at {path}: build one with "
                                          f"`{COMPILE_COMMAND} --release-dir {path.parent}`"])
    root = path.resolve()
    report = VerifyReport(root, False, details={"release_dir": str(root)})
    try:
        manifest = read_manifest(root)
    except ReleaseError as e:
        manifest, report.problems = None, [str(e)]
    if manifest is None and not report.problems:
        report.problems.append(f"{root} is incomplete (no release.json): its build did not finish; rerun "
                               f"`{COMPILE_COMMAND} --release-dir {root.parent}` with the same options, it resumes")
    if manifest is not None:
        report.details.update(name=manifest.name, torch=manifest.torch, cuda=manifest.cuda,
                              transformers=manifest.transformers, kernels=manifest.kernels,
                              cuda_archs=manifest.cuda_archs, created_at=manifest.created_at)
        report.warnings += _wheelhouse_warnings(root, manifest)
    python_problem = _python_problem(root)
    report.problems += [python_problem] if python_problem else []
    report.problems += _location_problems(root, manifest)
    missing = missing_exec_bits(root)
    if missing:
        report.problems.append(f"{len(missing)} files lost their executable bit (e.g. {missing[0]}), as a copy "
                               f"with Globus or without permissions does: run `{FIX_COMMAND} {root}`")
    if run_engine and python_problem is None:
        _run_check(root, manifest, gpu, timeout, report)
        if report.details.get("cuda_available"):
            _attention_check(root, timeout, report)
        elif gpu is not False:
            report.details["attention_check"] = ("skipped: the release's torch sees no GPU here; run "
                                                 "`tgi-hpc release verify` on a GPU node to check the attention kernels")
    report.ok = not report.problems
    return report


def _release_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "PYTHONHOME"}}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_PROGRESS_BARS="1",
               TRANSFORMERS_VERBOSITY="error")
    return env


def _attention_check(root: Path, timeout: int, report: VerifyReport) -> None:
    """On a GPU: the engine's own attention self-check (`python -m engine.attention_check`, which picks the
    backend serve jobs will run and compares it with the reference), in the release's python."""
    argv = [str(root / "bin" / "python"), "-I", "-m", "engine.attention_check"]
    with tempfile.TemporaryDirectory(prefix="tgi-hpc-verify-") as cwd:
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=_release_env())
        except (OSError, subprocess.TimeoutExpired) as e:
            report.problems.append(f"the attention self-check could not run: {e}")
            return
    lines = proc.stdout.strip().splitlines()
    try:
        result = json.loads(lines[-1]) if lines else {}
    except ValueError:
        result = {}
    if proc.returncode != 0 or not result.get("ok"):
        why = (proc.stderr.strip() or proc.stdout.strip())[-1500:] or f"exit {proc.returncode}"
        report.problems.append(f"the engine's attention self-check failed on this GPU: {why}; "
                               f"rebuild the release with `{COMPILE_COMMAND}` (add --with-kernels only for flash-attn)")
        return
    report.details["attention_backend"] = result.get("attention_backend", "?")


# --- checks from outside --------------------------------------------------------------------------------

def _python_problem(root: Path) -> str | None:
    python = root / "bin" / "python"
    if python.exists():
        return None
    if not python.is_symlink():
        if (root / "pyvenv.cfg").is_file():
            return (f"{python} is missing (a copy that drops symlinks, like Globus, does that): run "
                    f"`{FIX_COMMAND} {root}` to recreate it from pyvenv.cfg")
        return f"{python} is missing: {root} is not a virtual environment; rebuild with `{COMPILE_COMMAND}`"
    home = pyvenv_cfg(root).get("home", "?")
    return (f"{python} points to {os.readlink(python)}, which does not exist here: load the Python the release "
            f"was built with (pyvenv.cfg home = {home}; e.g. `module load python/3.11`) before activating it, "
            f"or rebuild the release on this cluster with `{COMPILE_COMMAND}`")


def _location_problems(root: Path, manifest: Any) -> list[str]:
    old = recorded_location(root, manifest)
    if old is None or old == str(root) or (Path(old).exists() and Path(old).resolve() == root):
        return []
    return [f"the release was built at {old} but is now at {root}: bin/activate and the script shebangs still "
            f"point to {old}, so `source {root}/bin/activate` would not use it; run `{FIX_COMMAND} {root}` "
            f"(rewrites them), or rebuild it offline from its own wheelhouse: `{COMPILE_COMMAND} --offline "
            f"--wheelhouse {root}/wheelhouse --release-dir {root.parent}`"]


def _wheelhouse_warnings(root: Path, manifest: Any) -> list[str]:
    warnings = []
    missing = [name for name in manifest.wheelhouse if not (root / WHEELHOUSE / name).is_file()]
    if missing:
        warnings.append(f"{len(missing)} wheels of the manifest are missing from {root / WHEELHOUSE} (e.g. "
                        f"{missing[0]}): an offline rebuild from it is no longer possible")
    lock = root / LOCK
    if not lock.is_file() or sha256_file(lock) != manifest.lock_sha256:
        warnings.append(f"{lock} is missing or changed since the build (manifest lock_sha256 differs)")
    return warnings


def _run_check(root: Path, manifest: Any, gpu: bool | None, timeout: int, report: VerifyReport) -> None:
    mode = {True: "yes", False: "no", None: "auto"}[gpu]
    argv = [str(root / "bin" / "python"), "-I", "-m", "tgi_hpc.release.selftest", "check", mode]
    env = _release_env()
    with tempfile.TemporaryDirectory(prefix="tgi-hpc-verify-") as cwd:
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)
        except (OSError, subprocess.TimeoutExpired) as e:
            report.problems.append(f"the release's python could not run the check: {e}")
            return
    try:
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        report.problems.append(f"the release's python failed before reporting (exit {proc.returncode}): "
                               f"{proc.stderr.strip()[-1500:]}\nrebuild the release with `{COMPILE_COMMAND}`")
        return
    report.details.update(result["info"])
    report.problems += result["problems"]
    report.warnings += result["warnings"]
    if manifest is not None:
        for key in ("torch", "transformers"):
            found = result["info"].get(key)
            if found and found != getattr(manifest, key):
                report.problems.append(f"{key} {found} is installed but the manifest says {getattr(manifest, key)}: "
                                       f"something was installed into the release after its build; rebuild it "
                                       f"with `{COMPILE_COMMAND}` into a new directory")


__all__ = ["VerifyReport", "verify_release"]
