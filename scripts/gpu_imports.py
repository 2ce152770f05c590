"""Import every engine module and every test module the GPU check runs; print what fails.

    python scripts/gpu_imports.py                      # as installed (the GPU machine, after the bundle)
    python scripts/gpu_imports.py --as-machine BUNDLE  # here: only the GPU machine's packages + BUNDLE

--as-machine rebuilds the GPU machine's Python on this one: an interpreter started without site-packages
(-S) whose path holds only (1) BUNDLE's wheels installed into an empty target, as the machine installs
them (pip --target, for CPython 3.12 manylinux x86-64), (2) links to the distributions installed here that
are on the machine's list (scripts/gpu_machine_packages.txt), torch included, and (3) the repository. A
wheel built for CPython 3.12 alone (not abi3, not pure Python) cannot load in this 3.11, so for those the
same version installed here stands in, and --py312 imports the 3.12 build's own modules with a Python
3.12 (pure wheels in the target beside it). Exit 1 when anything fails to import.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_bundle  # noqa: E402


def module_names() -> list[str]:
    names = []
    for path in sorted((ROOT / "engine").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__main__":
            continue
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names + [p.stem for p in gpu_bundle.gpu_test_files()]


def import_all(names: list[str]) -> dict[str, str]:
    for extra in ("scripts", "tests", "tests/engine", "."):
        sys.path.insert(0, str(ROOT / extra))
    import importlib
    failures = {}
    for name in names:
        try:
            importlib.import_module(name)
        except BaseException as error:  # noqa: BLE001 (a test module's pytest.skip is a failure here too)
            failures[name] = "".join(traceback.format_exception_only(type(error), error)).strip()[-600:]
    return failures


def install(bundle: Path, target: Path) -> list[dict]:
    """pip-install BUNDLE's wheels into `target` as for the machine; returns the manifest's wheel records."""
    wheels = sorted((bundle / "wheels").glob("*.whl"))
    platforms = [arg for platform in gpu_bundle.PLATFORMS for arg in ("--platform", platform)]
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp", *platforms,
                    "--target", str(target), *map(str, wheels)], check=True, timeout=300)
    return [gpu_bundle.wheel_record(w) for w in wheels]


def only_py312(record: dict) -> bool:
    return not record["pure"] and not any("abi3" in tag for tag in record["tags"])


def link_machine_packages(dest: Path, skip: set[str], stand_ins: set[str]) -> None:
    """Links in `dest` to the installed distributions on the machine's list (+ `stand_ins`), none of `skip`."""
    from importlib import metadata
    machine = set(gpu_bundle.machine_packages())
    for dist in metadata.distributions():
        name = gpu_bundle.canonicalize_name(dist.metadata["Name"])
        if name in skip or (name not in machine and name not in stand_ins):
            continue
        base = Path(dist.locate_file(""))
        for top in {Path(str(f)).parts[0] for f in dist.files or []}:
            source, link = base / top, dest / top
            if top.endswith(".pth") or top == ".." or not source.exists() or link.exists():
                continue
            link.symlink_to(source)


def as_machine(bundle: Path, py312: str | None, modules: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="gpu-imports-") as tmp:
        target, machine_dir = Path(tmp) / "target", Path(tmp) / "machine"
        machine_dir.mkdir()
        records = install(bundle, target)
        binary = {gpu_bundle.canonicalize_name(r["distribution"]): r for r in records if only_py312(r)}
        from importlib import metadata
        for name, record in binary.items():
            if metadata.version(name) != record["version"]:
                print(f"{name}: the bundle has {record['version']}, this machine {metadata.version(name)}")
                return 1
        only312 = Path(tmp) / "py312"      # the 3.12 builds, for --py312; this 3.11 uses its own
        only312.mkdir()
        for record in binary.values():
            for module in record["modules"]:
                for path in target.glob(module + "*"):
                    shutil.move(str(path), only312 / path.name)
        carried = {gpu_bundle.canonicalize_name(r["distribution"]) for r in records}
        link_machine_packages(machine_dir, skip=carried - set(binary), stand_ins=set(binary))
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(target), str(machine_dir)])
        env.setdefault("TRITON_INTERPRET", "1")
        rc = subprocess.run([sys.executable, "-S", str(Path(__file__)), "--json", "--modules", ",".join(modules)],
                            env=env, timeout=600).returncode
        if py312 and binary:
            modules = sorted({m for r in binary.values() for m in r["modules"] if not m.startswith("_")})
            code = "import importlib, sys; [importlib.import_module(m) for m in sys.argv[1:]]; print('3.12 ok')"
            env312 = {**env, "PYTHONPATH": os.pathsep.join([str(only312), str(target)])}
            env312.pop("TRITON_INTERPRET", None)
            rc |= subprocess.run([py312, "-S", "-c", code, *modules], env=env312, timeout=120).returncode
        return rc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--as-machine", type=Path, metavar="BUNDLE", help="see the module docstring")
    parser.add_argument("--py312", help="a Python 3.12 to import the bundle's 3.12-only builds with")
    parser.add_argument("--json", action="store_true", help="print the failures as one JSON object")
    parser.add_argument("--modules", help="comma-separated modules to import instead of all")
    args = parser.parse_args()
    names = args.modules.split(",") if args.modules else module_names()
    if args.as_machine:
        sys.exit(as_machine(args.as_machine, args.py312, names))
    failures = import_all(names)
    if args.json:
        print(json.dumps({"modules": len(names), "failures": failures}))
    else:
        for name, error in failures.items():
            print(f"{name}: {error}")
        print(f"{len(names) - len(failures)} of {len(names)} modules imported")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
