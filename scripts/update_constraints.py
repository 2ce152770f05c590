"""The pinned environment: check that a venv matches the constraints files, or rewrite them from it.

    python scripts/update_constraints.py --check    # exit 1, naming each package, if the venv differs
    python scripts/update_constraints.py --write    # pin what this venv has (after TGI_HPC_DEPS=newest setup)

tgi_hpc/release/constraints.txt holds the engine's runtime closure (what `tgi-hpc compile` installs);
scripts/constraints-test.txt holds everything else the test environment has. torch and numpy are never
pinned in the release file: torch is chosen per machine (CUDA on clusters) and numpy follows it.
"""
from __future__ import annotations

import argparse
import importlib.metadata as metadata
import sys
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
RELEASE = ROOT / "tgi_hpc" / "release" / "constraints.txt"
TEST = ROOT / "scripts" / "constraints-test.txt"
ENGINE_ROOTS = ("transformers", "tokenizers", "safetensors", "starlette", "uvicorn", "prometheus-client", "jinja2",
                "llguidance", "jsonschema", "pydantic", "huggingface-hub", "pillow", "num2words")
NEVER = {"torch", "torchvision", "tgi-hpc", "pip", "setuptools", "wheel"}   # torchvision follows torch
NEVER_IN_RELEASE = {"numpy", "typing-extensions"}


def normalize(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def read(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[normalize(name)] = version
    return pins


def installed() -> dict[str, str]:
    return {normalize(d.metadata["Name"]): d.version for d in metadata.distributions()
            if normalize(d.metadata["Name"]) not in NEVER and not normalize(d.metadata["Name"]).startswith("nvidia-")}


def engine_closure(versions: dict[str, str]) -> set[str]:
    seen: set[str] = set()
    stack = list(ENGINE_ROOTS)
    while stack:
        name = normalize(stack.pop())
        if name in seen or name in NEVER or name in NEVER_IN_RELEASE or name not in versions:
            continue
        seen.add(name)
        for spec in metadata.distribution(name).requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                stack.append(req.name)
    return seen


def check() -> int:
    have, pinned = installed(), {**read(TEST), **read(RELEASE)}
    wrong = [f"{name}: pinned {version}, installed {have.get(name, 'nothing')}"
             for name, version in sorted(pinned.items()) if have.get(name) != version.split("+")[0]
             and have.get(name) != version]
    # a package nothing pins (a developer's own tool) is only named: pyproject's requirements are all pinned
    # (tests/tgi_hpc/test_constraints.py), so CI's fresh venv has none
    for name in sorted(set(have) - set(pinned)):
        print(f"update_constraints: note: {name} {have[name]} is installed but not pinned", file=sys.stderr)
    for line in wrong:
        print(f"update_constraints: {line}", file=sys.stderr)
    if wrong:
        print("update_constraints: the venv is not the pinned environment; rerun scripts/setup.sh, or pin it "
              "on purpose with scripts/update_constraints.py --write", file=sys.stderr)
        return 1
    return 0


def write() -> int:
    have = installed()
    engine = engine_closure(have)
    keep = lambda path: "".join(line + "\n" for line in path.read_text().splitlines() if line.startswith("#"))
    RELEASE.write_text(keep(RELEASE) + "".join(f"{n}=={have[n]}\n" for n in sorted(engine)))
    TEST.write_text(keep(TEST) + "".join(f"{n}=={have[n]}\n" for n in sorted(set(have) - engine)))
    print(f"pinned {len(engine)} engine and {len(have) - len(engine)} other packages")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--check", action="store_true")
    group.add_argument("--write", action="store_true")
    sys.exit(check() if parser.parse_args().check else write())
