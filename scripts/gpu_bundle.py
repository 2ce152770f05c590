"""What the borrowed GPU machine lacks, collected into one ignored folder that travels with a device call.

    python scripts/gpu_bundle.py DIR [--max-mib 40]        # what `scripts/gpu_check.sh --prepare DIR` runs

Which packages: every import (module level and inside functions: a static read) of the engine, of the
test modules the GPU check runs (`gpu`-marked and kernel tests) with their helpers, and of the scripts
its stages run, followed through the repository's own modules. Each top-level name is either the
repository's own, the standard library's, on the machine (scripts/gpu_machine_packages.txt) at the version
installed here (or at any version: torch, Triton, numpy, whose CUDA builds are the point), carried as a
wheel, or in OPTIONAL (the engine runs without it, and why). A name in none of these fails the
prepare: a new dependency has to be classified before it can break a GPU run.

The wheels: the version installed here (the one CI tests), for CPython 3.12 manylinux x86-64 (or pure
Python), through `pip download` from pip's configured indexes (offline here: a local index). Their
Requires-Dist (markers read for Python 3.12 on Linux) are followed: a requirement is met on the machine
when the package is there and either the requirement names no version or the machine's version is
known and in range; otherwise that wheel is carried too.

Also carried: SmolLM2's tokenizer and config files (tokenizer/, for the 8B-shaped benchmark). No real
checkpoint fits: SmolLM2-135M, the smallest real decoder here, is 98 MB as its Q4_1 GGUF and 269 MB in
bf16, over the size limit; the GPU tests build their tiny random checkpoints on the machine.

DIR/manifest.json lists the wheels (distribution, version, file, whether pure Python, top-level modules
from RECORD), the tokenizer files and every import's classification.
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import re
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
MACHINE_LIST = ROOT / "scripts" / "gpu_machine_packages.txt"
OWN = {"engine", "tgi_hpc"}

# The files the GPU check imports or runs, besides all of engine/ (followed into the repo's own modules).
TEST_DIR = ROOT / "tests" / "engine"
SCRIPTS = ["bench_engine.py", "host_overhead.py", "bench_quant.py", "bench_moe.py", "bench_attention.py",
           "gpu_check_report.py", "make_models.py"]
EXTRA_FILES = ["tests/conftest.py", "tests/support/skip_guard.py"]

# Imported somewhere on these paths, absent on the machine, and not needed there.
OPTIONAL = {
    "flash_attn": "an optional attention backend; selection falls back to the Triton kernels",
    "bitsandbytes": "only for --quantize bitsandbytes*, refused with a message when absent",
    "openai": "used only by a CPU test of test_lora.py (the server's OpenAI routes), not by a gpu test",
    "torchvision": "the `vision` extra (Mistral 3, SmolVLM, Command A Vision processors); scripts/tiny_vlms.py only "
                   "checks whether it imports, and no gpu test builds those models",
}

MACHINE_BUILDS = {"torch", "triton", "numpy"}
PY312 = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.3",
         "implementation_name": "cpython", "platform_python_implementation": "CPython",
         "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix"}
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (39, 35, 34, 31, 28, 27, 24, 17)] + ["manylinux2014_x86_64",
                                                                                     "manylinux1_x86_64"]
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json",
                   "chat_template.jinja", "special_tokens_map.json"]


def machine_packages(path: Path = MACHINE_LIST) -> dict[str, str | None]:
    """{canonical name: version or None} from the machine's package list."""
    packages: dict[str, str | None] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            packages[canonicalize_name(name)] = version or None
    return packages


def gpu_test_files() -> list[Path]:
    """The test modules the GPU check runs: `gpu`-marked ones and the kernel tests."""
    kernel = {p for pattern in ("test_*triton*.py", "test_*kernel*.py", "test_quant_gemm.py")
              for p in TEST_DIR.glob(pattern)}
    marked = {p for p in TEST_DIR.glob("test_*.py") if "pytest.mark.gpu" in p.read_text()}
    return sorted(kernel | marked)


def _local_file(module: str) -> list[Path]:
    """Files of the repo that importing `module` runs (package __init__s included)."""
    parts = module.split(".")
    bases = [ROOT] if parts[0] in OWN else [TEST_DIR, ROOT / "scripts"]
    found: list[Path] = []
    for base in bases:
        for i in range(1, len(parts) + 1):
            pkg, mod = base.joinpath(*parts[:i], "__init__.py"), base.joinpath(*parts[:i - 1], parts[i - 1] + ".py")
            found += [p for p in (pkg, mod) if p.is_file()]
    return found


def scan_imports() -> dict[str, list[str]]:
    """{top-level name: files importing it} over the engine, the GPU check's tests and scripts, followed."""
    todo = list((ROOT / "engine").rglob("*.py")) + gpu_test_files()
    todo += [ROOT / "scripts" / s for s in SCRIPTS] + [ROOT / f for f in EXTRA_FILES]
    seen: set[Path] = set()
    names: dict[str, list[str]] = {}
    while todo:
        path = todo.pop()
        if path in seen or not path.is_file():
            continue
        seen.add(path)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            modules = []
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            for module in modules:
                local = _local_file(module)
                todo += local
                if not local and module == modules[0]:
                    names.setdefault(module.split(".")[0], []).append(str(path.relative_to(ROOT)))
    return names


def classify(names: dict[str, list[str]], machine: dict[str, str | None]) -> tuple[dict[str, str], list[str]]:
    """({name: how it is met}, [distributions to carry]); raises SystemExit naming unclassified imports."""
    top_to_dists = metadata.packages_distributions()
    table: dict[str, str] = {}
    carry: list[str] = []
    problems = []
    for name in sorted(names):
        dists = [canonicalize_name(d) for d in top_to_dists.get(name, [])]
        if name in sys.stdlib_module_names or name in OWN or _local_file(name):
            table[name] = "own or stdlib"
        elif name in OPTIONAL:
            table[name] = f"optional: {OPTIONAL[name]}"
        elif dists and all(d in machine and not _differs(d, machine) for d in dists):
            table[name] = f"on the machine ({', '.join(dists)})"
        elif dists:
            table[name] = f"carried ({', '.join(dists)})"
            carry += [d for d in dists if d not in machine or _differs(d, machine)]
        else:
            problems.append(f"{name} (imported by {', '.join(sorted(set(names[name]))[:3])})")
    if problems:
        raise SystemExit("gpu_bundle: imports neither installed here, on the GPU machine nor in OPTIONAL: "
                         + "; ".join(problems))
    return table, carry


def _differs(dist: str, machine: dict[str, str | None]) -> bool:
    """The machine's known version of `dist` is not the one installed here (and the machine's build is not
    the point: torch, Triton and numpy are its CUDA builds, whatever their version)."""
    if dist in MACHINE_BUILDS or machine.get(dist) is None:
        return False
    return Version(machine[dist]) != Version(metadata.version(dist))


def _met_on_machine(requirement: Requirement, machine: dict[str, str | None]) -> bool:
    name = canonicalize_name(requirement.name)
    if name not in machine:
        return False
    version = machine[name]
    if not requirement.specifier:
        return True
    return version is not None and requirement.specifier.contains(Version(version), prereleases=True)


def closure(carry: list[str], machine: dict[str, str | None]) -> dict[str, str]:
    """{distribution: version installed here} for `carry` and every requirement the machine does not meet."""
    todo, chosen = list(carry), {}
    while todo:
        name = canonicalize_name(todo.pop())
        if name in chosen:
            continue
        dist = metadata.distribution(name)
        chosen[name] = dist.version
        for text in dist.requires or []:
            requirement = Requirement(text)
            if requirement.marker and not requirement.marker.evaluate({**PY312, "extra": ""}):
                continue
            if not _met_on_machine(requirement, machine):
                todo.append(requirement.name)
    return chosen


def download(wheels: dict[str, str], dest: Path) -> None:
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    pins = [f"{name}=={version}" for name, version in sorted(wheels.items())]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(dest), *pins],
                   check=True, timeout=600)


def wheel_record(path: Path) -> dict:
    """Distribution, version, purity and the top-level modules a wheel installs (from its RECORD)."""
    name, version, _, tags = parse_wheel_filename(path.name)
    with zipfile.ZipFile(path) as archive:
        record = next(n for n in archive.namelist() if n.endswith(".dist-info/RECORD"))
        files = [line.split(",", 1)[0] for line in archive.read(record).decode().splitlines() if line]
    tops = sorted({f.split("/", 1)[0].removesuffix(".py") for f in files
                   if not f.split("/", 1)[0].endswith((".dist-info", ".data")) and not f.startswith("..")})
    tops = [re.sub(r"\.(cpython|abi3).*$", "", t) for t in tops]
    return {"distribution": str(name), "version": str(version), "file": path.name,
            "pure": all(t.abi == "none" for t in tags), "tags": sorted(str(t) for t in tags),
            "modules": sorted(set(tops)), "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def incompatible(record: dict) -> bool:
    """The wheel installs on none of CPython 3.12's manylinux x86-64 tags."""
    from packaging.tags import compatible_tags, cpython_tags
    platforms = PLATFORMS + ["linux_x86_64"]
    supported = {str(t) for t in [*cpython_tags((3, 12), platforms=platforms),
                                  *compatible_tags((3, 12), platforms=platforms)]}
    return not supported & set(record["tags"])


def tokenizer_dir() -> Path:
    sys.path.insert(0, str(ROOT / "scripts"))
    from make_models import ensure_model
    return ensure_model("smollm2")


def prepare(out: Path, max_mib: float = 40.0) -> dict:
    machine = machine_packages()
    table, carry = classify(scan_imports(), machine)
    wheels = closure(carry, machine)
    out.mkdir(parents=True, exist_ok=True)
    for old in ("wheels", "tokenizer"):
        shutil.rmtree(out / old, ignore_errors=True)
    download(wheels, out / "wheels")
    (out / "tokenizer").mkdir()
    source = tokenizer_dir()
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, out / "tokenizer" / name)
    manifest = {"python": "3.12", "platform": "manylinux x86-64", "imports": table,
                "wheels": [wheel_record(p) for p in sorted((out / "wheels").glob("*.whl"))],
                "tokenizer": sorted(p.name for p in (out / "tokenizer").iterdir()),
                "checkpoint": None, "checkpoint_why": "no real decoder fits (SmolLM2-135M: 98 MB GGUF, 269 MB bf16)"}
    bad = [w["file"] for w in manifest["wheels"] if incompatible(w)]
    if bad:
        raise SystemExit(f"gpu_bundle: not installable on CPython 3.12 manylinux x86-64: {', '.join(bad)}")
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    manifest["mib"] = round(size / 2**20, 2)
    if size > max_mib * 2**20:
        raise SystemExit(f"gpu_bundle: {out} holds {size / 2**20:.1f} MiB, over {max_mib} MiB")
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the folder to fill (keep it ignored by git)")
    parser.add_argument("--max-mib", type=float, default=40.0)
    args = parser.parse_args()
    manifest = prepare(args.out, args.max_mib)
    for wheel in manifest["wheels"]:
        print(f"{wheel['file']}", file=sys.stderr)
    print(f"{args.out}: {len(manifest['wheels'])} wheels, tokenizer, {manifest['mib']} MiB")


if __name__ == "__main__":
    main()
