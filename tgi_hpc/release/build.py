"""Engine releases: a self-contained virtual environment built once, which serve jobs only activate.

Layout (the release directory IS the venv root, so `RELEASES/current/bin/activate` exists):

    RELEASES/
      current -> <name>            relative symlink to the newest complete release
      <name>/
        bin/ lib/ pyvenv.cfg       the virtual environment (python -m venv / virtualenv)
        wheelhouse/                every wheel needed to recreate the venv offline
        requirements.lock          pinned `pip freeze` of the venv, with --hash lines when all wheels are here
        release.json               the manifest, written LAST: no release.json = an incomplete release
        build.log                  pip's output
        .tgi-hpc-build.json        steps done so far (removed once the manifest is written)

The venv is built where it will live: a venv cannot be renamed (bin/activate and script shebangs hold its
path), so an interrupted build resumes in place from the steps it recorded, never via a rename.
Every package is installed from the wheelhouse alone (pip config and PIP_* variables ignored), which proves
on every build that the wheelhouse can recreate the release offline.

This module drives a build (target, lock, resume, `current`); the parts live next to it: spec
(what to build, inputs, name), builder (the steps), manifest (release.json), kernels (flash-attn),
verify, repair and selftest (checks and fixes).
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tgi_hpc.errors import ReleaseError
from tgi_hpc.release.builder import STATE, Progress, ReleaseBuilder
from tgi_hpc.release.kernels import find_nvcc
from tgi_hpc.release.manifest import MANIFEST, Manifest, atomic_write, read_manifest, write_manifest
from tgi_hpc.release.spec import ReleaseSpec, default_name, inputs_hash, release_inputs

_LOCK_FILE = ".tgi-hpc-build.lock"
CURRENT = "current"


def print_to_stderr(message: str) -> None:
    print(f"[tgi-hpc compile] {message}", file=sys.stderr, flush=True)


def _target(spec: ReleaseSpec, inputs: dict[str, Any]) -> Path:
    root = Path(spec.release_dir).expanduser().resolve()
    if (root / MANIFEST).exists() or (root / "pyvenv.cfg").exists():
        raise ReleaseError(f"{root} is a release itself; --release-dir is the folder where releases live "
                           f"(pass {root.parent}, with --name {root.name} to address this one)")
    name = spec.name or default_name(spec, inputs)
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9._+-]*", name) or name == CURRENT:
        raise ReleaseError(f"bad release name {name!r}: use letters, digits and . _ + - (and not {CURRENT!r})")
    return root / name


# --- the build ----------------------------------------------------------------------------------------

def build_release(spec: ReleaseSpec, progress: Progress = print_to_stderr) -> Manifest:
    """Build (or resume, or confirm) the release described by `spec`; returns its manifest.

    A complete release with the same inputs is left untouched. A partial one resumes from its last
    finished step. The manifest is written last, and only then does RELEASES/current move to it.
    """
    inputs = release_inputs(spec)
    digest = inputs_hash(inputs)
    release_dir = _target(spec, inputs)
    existing = read_manifest(release_dir)
    if existing is not None:
        return _up_to_date(release_dir, existing, inputs, digest, progress)
    if spec.with_kernels:
        find_nvcc()  # fail before spending an hour on the rest
    with _build_lock(release_dir):
        existing = read_manifest(release_dir)  # another build may have finished while we waited
        if existing is not None:
            return _up_to_date(release_dir, existing, inputs, digest, progress)
        state = _start_state(release_dir, digest, progress)
        manifest = ReleaseBuilder(spec, release_dir, inputs, state, progress).run()
        write_manifest(release_dir, manifest)
        (release_dir / STATE).unlink()
        _point_current(release_dir)
    (release_dir / _LOCK_FILE).unlink(missing_ok=True)
    progress(f"release complete: {release_dir} (torch {manifest.torch}, CUDA {manifest.cuda or 'none'}); "
             f"{release_dir.parent / CURRENT} now points to it")
    return manifest


def _up_to_date(release_dir: Path, manifest: Manifest, inputs: dict[str, Any], digest: str,
                progress: Progress) -> Manifest:
    if manifest.inputs_hash != digest:
        changed = sorted(k for k in set(inputs) | set(manifest.inputs) if inputs.get(k) != manifest.inputs.get(k))
        raise ReleaseError(f"{release_dir} is a complete release built from different inputs (changed: "
                           f"{', '.join(changed) or 'inputs hash'}); a release is never rebuilt in place, since "
                           "running jobs may use it: leave out --name (default names include the inputs hash), "
                           "choose another name, or delete this release first")
    current = release_dir.parent / CURRENT
    if not current.exists():  # missing or dangling
        _point_current(release_dir)
    progress(f"release {release_dir} is up to date (inputs {digest[:12]}); nothing to rebuild")
    return manifest


@contextlib.contextmanager
def _build_lock(release_dir: Path) -> Iterator[None]:
    release_dir.mkdir(parents=True, exist_ok=True)
    with open(release_dir / _LOCK_FILE, "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            raise ReleaseError(f"another `tgi-hpc compile` is building {release_dir} right now; wait for it "
                               "(or, if it died, rerun: it resumes)") from e
        except OSError:  # some network filesystems have no flock; go on without
            pass
        yield


def _start_state(release_dir: Path, digest: str, progress: Progress) -> dict[str, Any]:
    path = release_dir / STATE
    others = [p for p in release_dir.iterdir() if p.name not in {STATE, _LOCK_FILE}]
    if path.exists():
        state = json.loads(path.read_text())
        if state.get("inputs_hash") == digest:
            progress(f"resuming the build in {release_dir} (done: {', '.join(state['done']) or 'nothing'})")
            return state
        progress(f"{release_dir} holds a partial build of other inputs: starting over")
        for p in others:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
    elif others:
        raise ReleaseError(f"{release_dir} is not empty and is not a tgi-hpc release (no {MANIFEST} or {STATE}); "
                           "choose another release name or --release-dir")
    state = {"inputs_hash": digest, "done": [], "project_version": None}
    atomic_write(path, json.dumps(state))
    return state


def _point_current(release_dir: Path) -> None:
    """RELEASES/current -> <name>, relative so that RELEASES can move as a whole; swapped atomically."""
    link = release_dir.parent / CURRENT
    tmp = release_dir.parent / f".{CURRENT}.{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(release_dir.name)
    os.replace(tmp, link)


__all__ = ["CURRENT", "build_release", "print_to_stderr"]
