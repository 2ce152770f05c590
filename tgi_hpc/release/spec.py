"""What a release is built from: the spec, the inputs that determine its content, and its default name."""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tgi_hpc import __version__
from tgi_hpc.errors import ReleaseError
from tgi_hpc.release.kernels import DEFAULT_CUDA_ARCHS, KERNELS_SPEC, parse_cuda_archs
from tgi_hpc.release.manifest import sha256_file
from tgi_hpc.release.origin import installed_origin

COMPILE_COMMAND = "tgi-hpc compile"  # named in every "rebuild" hint
OWN_BUILD_REQUIRES = ("hatchling>=1.21",)   # pyproject.toml's build-system, for a source pip fetches (git)
_SKIP_SOURCE_DIRS = {"__pycache__", "build", "dist", "tests", "docs", "node_modules"}


@dataclass
class ReleaseSpec:
    """What to build and where: the release goes to `release_dir/name` (RELEASES/<name>), a venv root.

    `release_dir` is where releases live (the profile's paths.releases); `current` is made there.
    `name` defaults to `release_name(spec)`, which changes with the inputs: a rerun is a no-op, and a
    changed spec or code gives a new release next to the old one.
    """

    release_dir: Path
    name: str | None = None
    python: str = sys.executable                  # base interpreter of the venv
    torch_spec: str = "torch==2.13.0"             # on clusters a CUDA build (DRAC wheelhouse: torch==2.x)
    extras: list[str] = field(default_factory=lambda: ["engine"])
    cuda_archs: list[str] = field(default_factory=list)   # "8.0", "9.0"...; empty = DEFAULT_CUDA_ARCHS for kernels
    with_kernels: bool = False                    # build flash-attn from source (needs nvcc + CUDA torch)
    kernels_spec: str = KERNELS_SPEC
    project_source: Path | None = None            # checkout dir or .whl; None = this checkout, else where this
                                                  # tgi-hpc was installed from (origin.py), else PyPI
    pip_args: list[str] = field(default_factory=list)     # e.g. ["--no-index", "--find-links", WHEELHOUSE]
    system_site_packages: bool = False
    venv_tool: Literal["venv", "virtualenv"] = "venv"     # DRAC documents `virtualenv --no-download`
    compile_bytecode: bool = True                 # .pyc up front: a read-only release cannot cache them later


def _python_identity(python: str) -> str:
    code = "import platform; print(platform.python_implementation().lower(), platform.python_version())"
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise ReleaseError(f"cannot run the base Python {python!r} ({e}); pass an existing interpreter "
                           "(on clusters: `module load python/3.11` first)") from e
    impl, version = out.split()
    if tuple(int(p) for p in version.split(".")[:2]) < (3, 10):
        raise ReleaseError(f"{python} is Python {version}; the engine needs >= 3.10 (module load python/3.11)")
    return f"{impl}-{version}"


def _checkout_root() -> Path | None:
    root = Path(__file__).resolve().parents[2]  # tgi_hpc/release/spec.py -> the checkout
    pyproject = root / "pyproject.toml"
    if pyproject.is_file() and 'name = "tgi-hpc"' in pyproject.read_text() and (root / "engine").is_dir():
        return root
    return None


def _source_digest(root: Path) -> str:
    """Hash of the files a wheel is built from; a code change means a new release."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in _SKIP_SOURCE_DIRS
                             and not d.endswith(".egg-info"))
        for name in sorted(filenames):
            if name.endswith((".pyc", ".pyo")):
                continue
            path = Path(dirpath) / name
            h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def resolve_project(spec: ReleaseSpec) -> tuple[str, str, list[str]]:
    """(pip requirement, identity for the inputs hash, build requirements to keep in the wheelhouse)."""
    extras = f"[{','.join(spec.extras)}]" if spec.extras else ""
    source = spec.project_source or _checkout_root()
    if source is None:   # an installed tgi-hpc: the engine comes from where it came from (PEP 610)
        origin = installed_origin()
        if origin.kind == "index":
            return f"tgi-hpc{extras}=={__version__}", f"pypi:{__version__}", []
        if origin.kind in ("vcs", "archive"):
            return f"tgi-hpc{extras} @ {origin.url}", f"{origin.kind}:{origin.url}", list(OWN_BUILD_REQUIRES)
        source = origin.path
        if not Path(source).exists():
            raise ReleaseError(f"tgi-hpc was installed from {source}, which is gone: install it again from a wheel, "
                               "a directory or git (pip install git+URL), then compile")
    source = Path(source).resolve()
    if source.is_file() and source.suffix == ".whl":
        return f"tgi-hpc{extras} @ {source.as_uri()}", f"wheel:{sha256_file(source)}", []
    if not (source / "pyproject.toml").is_file():
        raise ReleaseError(f"project source {source} is neither a tgi-hpc checkout (no pyproject.toml) nor a .whl")
    return f"tgi-hpc{extras} @ {source.as_uri()}", f"source:{_source_digest(source)}", _build_requires(source)


def _build_requires(source: Path) -> list[str]:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        return ["hatchling"]
    with open(source / "pyproject.toml", "rb") as f:
        return list(tomllib.load(f).get("build-system", {}).get("requires", []))


def release_inputs(spec: ReleaseSpec) -> dict[str, Any]:
    """What determines the release's content. pip_args (where wheels come from) are left out."""
    archs = parse_cuda_archs(spec.cuda_archs) or (DEFAULT_CUDA_ARCHS if spec.with_kernels else [])
    return {
        "python": _python_identity(spec.python),
        "torch_spec": spec.torch_spec,
        "extras": sorted(spec.extras),
        "project": resolve_project(spec)[1],
        "with_kernels": spec.with_kernels,
        "kernels_spec": spec.kernels_spec if spec.with_kernels else None,
        "cuda_archs": archs,
        "system_site_packages": spec.system_site_packages,
        "venv_tool": spec.venv_tool,
    }


def inputs_hash(inputs: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def release_name(spec: ReleaseSpec) -> str:
    """The default directory name for `spec` under RELEASES: same inputs, same name."""
    return default_name(spec, release_inputs(spec))


def default_name(spec: ReleaseSpec, inputs: dict[str, Any]) -> str:
    """`release_name` from inputs already computed (they cost a subprocess and a source hash)."""
    torch = re.sub(r"[^A-Za-z0-9.]+", "", spec.torch_spec.split("==")[-1]) or "torch"
    py = "".join(inputs["python"].split("-")[1].split(".")[:2])
    return f"tgi-hpc-{__version__}-py{py}-torch{torch}-{inputs_hash(inputs)[:10]}"
