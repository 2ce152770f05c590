"""release.json, the manifest of a complete release: what it holds, how it was made, and file hashes.

Stdlib only: the release's own python imports this module (through tgi_hpc.release.verify).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tgi_hpc.errors import ReleaseError

MANIFEST = "release.json"
LOCK = "requirements.lock"
WHEELHOUSE = "wheelhouse"
MANIFEST_FORMAT = 1


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
    atomic_write(Path(release_dir) / MANIFEST, manifest.to_json())


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
