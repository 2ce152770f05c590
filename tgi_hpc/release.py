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
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tgi_hpc import __version__
from tgi_hpc.errors import ReleaseError

MANIFEST = "release.json"
LOCK = "requirements.lock"
WHEELHOUSE = "wheelhouse"
BUILD_LOG = "build.log"
STATE = ".tgi-hpc-build.json"
_LOCK_FILE = ".tgi-hpc-build.lock"
CURRENT = "current"
MANIFEST_FORMAT = 1
KERNELS_SPEC = "flash-attn"
KERNEL_BUILD_DEPS = ["ninja", "packaging", "psutil", "setuptools", "wheel", "einops"]
# Ampere, Ada, Hopper: the GPUs of Mila and DRAC; flash-attn 2 has no kernels below sm_80.
DEFAULT_CUDA_ARCHS = ["8.0", "8.6", "8.9", "9.0"]
_PIP_TIMEOUT_S = 3600
_KERNEL_TIMEOUT_S = 4 * 3600
_SKIP_SOURCE_DIRS = {"__pycache__", "build", "dist", "tests", "docs", "node_modules"}
_NOT_FOUND_HINT = ("A package or version is not available from the index/wheelhouse pip used: check the version "
                   "(--torch-spec), or on a node without internet run the build on the login node, or pass a "
                   "wheelhouse that holds it (--offline). ")
_LOCK_HEADER = ("# tgi-hpc engine release lock (pip freeze of the release venv).\n"
                "# Recreate offline: python -m pip install --no-index --find-links wheelhouse -r requirements.lock\n")

Progress = Callable[[str], None]


def print_to_stderr(message: str) -> None:
    print(f"[tgi-hpc compile] {message}", file=sys.stderr, flush=True)


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
    project_source: Path | None = None            # checkout dir or .whl; None = this checkout, else PyPI
    pip_args: list[str] = field(default_factory=list)     # e.g. ["--no-index", "--find-links", WHEELHOUSE]
    system_site_packages: bool = False
    venv_tool: Literal["venv", "virtualenv"] = "venv"     # DRAC documents `virtualenv --no-download`
    compile_bytecode: bool = True                 # .pyc up front: a read-only release cannot cache them later


@dataclass
class Manifest:
    """release.json: what the release holds and how it was made."""

    name: str
    location: str                 # absolute path the venv's scripts point to
    created_at: str
    tgi_hpc_version: str          # installed in the release
    built_by: str                 # version of the tgi-hpc that ran the build
    python: str
    torch: str
    cuda: str | None              # torch.version.cuda; None = CPU build
    transformers: str | None
    kernels: dict[str, str | None]
    cuda_archs: list[str]
    inputs_hash: str
    inputs: dict[str, Any]
    lock_sha256: str
    lock_hashes: bool             # requirements.lock carries --hash for every pin
    wheelhouse: dict[str, str]    # wheel file name -> sha256
    format: int = MANIFEST_FORMAT

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Manifest:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in names})


def read_manifest(release_dir: Path) -> Manifest | None:
    """The manifest of a complete release, or None when release.json is missing (incomplete build)."""
    path = Path(release_dir) / MANIFEST
    try:
        raw = json.loads(path.read_text())
        return Manifest.from_dict(raw)
    except FileNotFoundError:
        return None
    except (ValueError, TypeError) as e:
        raise ReleaseError(f"{path} is not a valid release manifest ({e}); rebuild the release with "
                           "`tgi-hpc compile`") from e


def write_manifest(release_dir: Path, manifest: Manifest) -> None:
    _atomic_write(Path(release_dir) / MANIFEST, manifest.to_json())


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def parse_cuda_archs(value: str | list[str]) -> list[str]:
    """'8.0,9.0', '80;90', 'sm_86 9.0a' -> ['8.0', '9.0', ...] (TORCH_CUDA_ARCH_LIST spelling)."""
    items = value if isinstance(value, list) else re.split(r"[,;\s]+", value)
    archs = []
    for item in (i.strip() for i in items if i.strip()):
        m = re.fullmatch(r"(?:sm_|compute_)?(\d{1,2})\.?(\d)([af]?)(\+PTX)?", item, re.IGNORECASE)
        if not m:
            raise ReleaseError(f"bad CUDA architecture {item!r}: use compute capabilities like 8.0, 8.6, 9.0 "
                               "(A100 = 8.0, A6000/A10 = 8.6, L40S = 8.9, H100 = 9.0)")
        arch = f"{int(m[1])}.{m[2]}{m[3].lower()}{'+PTX' if m[4] else ''}"
        if arch not in archs:
            archs.append(arch)
    return archs


def flash_attn_archs(archs: list[str]) -> list[str]:
    """flash-attn builds one cubin per major (sm_80 also runs on 8.6/8.9); it has none below 8.0."""
    majors = sorted({int(a.split(".")[0]) for a in archs})
    return [f"{m}0" for m in majors if m >= 8]


# --- inputs and naming --------------------------------------------------------------------------------

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
    root = Path(__file__).resolve().parents[1]
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


def _project(spec: ReleaseSpec) -> tuple[str, str, list[str]]:
    """(pip requirement, identity for the inputs hash, build requirements to keep in the wheelhouse)."""
    extras = f"[{','.join(spec.extras)}]" if spec.extras else ""
    source = spec.project_source or _checkout_root()
    if source is None:
        return f"tgi-hpc{extras}=={__version__}", f"pypi:{__version__}", []
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
        "project": _project(spec)[1],
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
    return _default_name(spec, release_inputs(spec))


def _default_name(spec: ReleaseSpec, inputs: dict[str, Any]) -> str:
    torch = re.sub(r"[^A-Za-z0-9.]+", "", spec.torch_spec.split("==")[-1]) or "torch"
    py = "".join(inputs["python"].split("-")[1].split(".")[:2])
    return f"tgi-hpc-{__version__}-py{py}-torch{torch}-{inputs_hash(inputs)[:10]}"


def _target(spec: ReleaseSpec, inputs: dict[str, Any]) -> Path:
    root = Path(spec.release_dir).expanduser().resolve()
    if (root / MANIFEST).exists() or (root / "pyvenv.cfg").exists():
        raise ReleaseError(f"{root} is a release itself; --release-dir is the folder where releases live "
                           f"(pass {root.parent}, with --name {root.name} to address this one)")
    name = spec.name or _default_name(spec, inputs)
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9._+-]*", name) or name == CURRENT:
        raise ReleaseError(f"bad release name {name!r}: use letters, digits and . _ + - (and not {CURRENT!r})")
    return root / name


def offline_pip_args(wheelhouse: Path) -> list[str]:
    """pip arguments that take every package from `wheelhouse` and nothing from the network."""
    return ["--no-index", "--find-links", str(wheelhouse)]


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
        manifest = _Builder(spec, release_dir, inputs, state, progress).run()
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
    _atomic_write(path, json.dumps(state))
    return state


def _point_current(release_dir: Path) -> None:
    """RELEASES/current -> <name>, relative so that RELEASES can move as a whole; swapped atomically."""
    link = release_dir.parent / CURRENT
    tmp = release_dir.parent / f".{CURRENT}.{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(release_dir.name)
    os.replace(tmp, link)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class _Builder:
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
            _atomic_write(self.dir / STATE, json.dumps(self.state))
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
        project, _, build_requires = _project(self.spec)
        self.wheelhouse.mkdir(exist_ok=True)
        self.pip_wheel([project, self.spec.torch_spec], "collect the wheels of the engine")
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
               "FLASH_ATTENTION_FORCE_BUILD": "TRUE", "MAX_JOBS": os.environ.get("MAX_JOBS") or str(_max_jobs())}
        self.pip_wheel(KERNEL_BUILD_DEPS, "collect the kernel build tools")
        self.pip_install(KERNEL_BUILD_DEPS, "install the kernel build tools")
        self.progress(f"kernels: compiling {self.spec.kernels_spec} for {env['TORCH_CUDA_ARCH_LIST']} with "
                      f"MAX_JOBS={env['MAX_JOBS']} (this takes 20-60 minutes)")
        self.pip_wheel([self.spec.kernels_spec], "compile flash-attn", extra=["--no-build-isolation", "--no-deps"],
                       env=env, timeout=_KERNEL_TIMEOUT_S)
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
        _atomic_write(self.dir / LOCK, text)
        return text, with_hashes


def probe_release(release_dir: Path, *, timeout: int = 300) -> dict[str, Any]:
    """Versions inside the release, asked of its own python (see tgi_hpc.release_verify's `probe`)."""
    python = Path(release_dir) / "bin" / "python"
    argv = [str(python), "-I", "-m", "tgi_hpc.release_verify", "probe"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=_clean_env(release_dir, False))
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError) as e:
        raise ReleaseError(f"the release python {python} could not report its versions (exit {proc.returncode}):\n"
                           f"{proc.stderr[-2000:]}") from e


def find_nvcc() -> str:
    """The CUDA compiler flash-attn needs, from PATH or $CUDA_HOME/bin; ReleaseError when there is none."""
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    nvcc = shutil.which("nvcc") or (cuda_home and shutil.which("nvcc", path=str(Path(cuda_home) / "bin")))
    if not nvcc:
        raise ReleaseError("--with-kernels needs the CUDA compiler, and nvcc is neither on PATH nor in "
                           "$CUDA_HOME/bin: load the CUDA toolkit matching torch's CUDA first (Mila: "
                           "`module load cuda/12.x`; DRAC: `module load cuda`), or build without --with-kernels "
                           "(the engine then uses PyTorch SDPA attention)")
    return nvcc


def check_torch_for_kernels(torch_cuda: str | None, torch_label: str, nvcc: str) -> None:
    """Kernels compile only against a CUDA torch, with an nvcc of the same CUDA major version."""
    if not torch_cuda:
        raise ReleaseError(f"--with-kernels needs a CUDA build of torch, but {torch_label} is a CPU build "
                           "(torch.version.cuda is None): pin a CUDA wheel (DRAC wheelhouse: torch==2.x is a CUDA "
                           "build; PyPI: --extra-index-url https://download.pytorch.org/whl/cu126) or drop "
                           "--with-kernels")
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    m = re.search(r"release (\d+)\.(\d+)", out)
    if m and m[1] != torch_cuda.split(".")[0]:
        raise ReleaseError(f"nvcc ({nvcc}) is CUDA {m[1]}.{m[2]} but {torch_label} was built for CUDA {torch_cuda}: "
                           f"load a CUDA {torch_cuda.split('.')[0]}.x toolkit module so that the kernels match torch")


def torch_wheel_cuda(wheel: Path) -> str | None:
    """torch.version.cuda of a torch wheel, read from its torch/version.py without installing it."""
    with zipfile.ZipFile(wheel) as z:
        return parse_torch_cuda(z.read("torch/version.py").decode())


def parse_torch_cuda(version_py: str) -> str | None:
    """The `cuda = '12.4'` (or None) line of torch/version.py."""
    m = re.search(r"^cuda(?:\s*:[^=]*)?\s*=\s*(?:None|['\"]([^'\"]*)['\"])", version_py, re.M)
    return m[1] if m and m[1] else None


# --- helpers --------------------------------------------------------------------------------------------

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


def _max_jobs() -> int:
    """nvcc jobs: one per core, but flash-attn needs ~4 GB per job."""
    cores = len(os.sched_getaffinity(0))
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3
    slurm_mem = os.environ.get("SLURM_MEM_PER_NODE")
    if slurm_mem and slurm_mem.isdigit():
        mem_gb = min(mem_gb, int(slurm_mem) / 1024)
    return max(1, min(cores, int(mem_gb // 4)))


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


_VERIFY_API = {"VerifyReport", "verify_release", "fix_permissions", "relocate_release", "repair_release"}


def __getattr__(name: str) -> Any:
    """`from tgi_hpc.release import verify_release` works too; it lives in release_verify (no import cycle)."""
    if name in _VERIFY_API:
        from tgi_hpc import release_verify
        return getattr(release_verify, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ReleaseSpec", "Manifest", "build_release", "read_manifest", "write_manifest", "release_name",
           "release_inputs", "parse_cuda_archs", "flash_attn_archs", "find_nvcc", "check_torch_for_kernels",
           "torch_wheel_cuda", "parse_torch_cuda", "offline_pip_args", "probe_release", "DEFAULT_CUDA_ARCHS"]
