"""The model store: where downloaded models live on the cluster, and how to find them again.

Layout (one plain folder per model and revision, loadable by the engine and by transformers as is):

    STORE/<org>--<name>/<revision>/config.json, tokenizer files, *.safetensors [+ index]
    STORE/<org>--<name>/<revision>/.tgi-hpc.json      manifest, written last: id, revision, commit, files
    STORE/<org>--<name>/<revision>/.tgi-hpc-partial/  downloads in progress (resumed by the next run)

A "/" in a revision (e.g. `refs/pr/1`) becomes "--" in the folder name; Hub ids never contain "--".
A folder without a manifest, or whose files no longer match it, is an incomplete download.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tgi_hpc.errors import ModelNotFoundError, UsageError

MANIFEST = ".tgi-hpc.json"
PARTIAL_DIR = ".tgi-hpc-partial"

# Hub rules: 1-96 of [A-Za-z0-9._-] per part, starting and ending with a letter, digit or "_", no "--"/"..".
_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9_])?"
_MODEL_ID = re.compile(rf"({_PART})/({_PART})")
_REVISION = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._/-]{0,127}")


@dataclass
class StoredModel:
    """One model revision in the store, as `tgi-hpc models` lists it."""

    model_id: str
    revision: str
    commit: str | None
    path: Path
    size_bytes: int
    format: str  # "safetensors", "bin", "gguf" or "unknown"
    complete: bool
    kind: str = "model"        # or "adapter": a PEFT adapter (adapter_config.json + adapter_model.safetensors)


def validate_model_id(model_id: str) -> str:
    """Return `model_id` if it is a Hub id ORG/NAME, else raise UsageError (it becomes a folder name)."""
    if not isinstance(model_id, str) or not _MODEL_ID.fullmatch(model_id) or "--" in model_id or ".." in model_id:
        raise UsageError(
            f"invalid model id {model_id!r}: expected ORG/NAME as on huggingface.co "
            "(1-96 letters, digits, '.', '_' or '-' per part, e.g. meta-llama/Llama-3.1-8B-Instruct)"
        )
    return model_id


def validate_revision(revision: str) -> str:
    """Return `revision` if it is a plain branch, tag or commit name, else raise UsageError."""
    bad = ("--", "..", "//")
    if not isinstance(revision, str) or not _REVISION.fullmatch(revision) or revision.endswith("/") or any(
            b in revision for b in bad):
        raise UsageError(
            f"invalid revision {revision!r}: expected a branch, tag or commit sha "
            "(letters, digits, '.', '_', '-', '/'; e.g. main, v1.0 or refs/pr/1)"
        )
    return revision


def model_dir(store: Path, model_id: str, revision: str = "main") -> Path:
    """The folder of `model_id` at `revision` in the store (whether or not it exists)."""
    org, name = validate_model_id(model_id).split("/")
    return Path(store) / f"{org}--{name}" / validate_revision(revision).replace("/", "--")


def list_models(store: Path) -> list[StoredModel]:
    """Every model revision in the store, complete or not, sorted by id then revision."""
    store = Path(store)
    if not store.is_dir():
        return []
    found = []
    for repo in sorted(p for p in store.iterdir() if p.is_dir() and "--" in p.name and not p.name.startswith(".")):
        for folder in sorted(p for p in repo.iterdir() if p.is_dir() and not p.name.startswith(".")):
            found.append(read_stored_model(folder))
    return sorted(found, key=lambda m: (m.model_id.lower(), m.revision))


def read_stored_model(folder: Path) -> StoredModel:
    """Describe one revision folder from its manifest, or from its files when the download is incomplete."""
    manifest = read_manifest(folder)
    if manifest is None:
        org, _, name = folder.parent.name.partition("--")
        size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
        return StoredModel(f"{org}/{name}", folder.name, None, folder, size, _guess_format(folder), False)
    files = manifest["files"]
    complete = all(_has_size(folder / f["path"], f["size"]) for f in files)
    return StoredModel(manifest["model_id"], manifest["revision"], manifest.get("commit"), folder,
                       sum(f["size"] for f in files), manifest.get("format", "unknown"), complete,
                       manifest.get("kind", "model"))


def remove_model(store: Path, model_id: str, revision: str | None = None) -> list[Path]:
    """Delete one revision (or all revisions) of a model; returns the folders removed.

    Raises ModelNotFoundError when there is nothing to remove.
    """
    repo = model_dir(store, model_id).parent
    if revision:
        targets = [model_dir(store, model_id, revision)]
    else:
        targets = sorted(repo.iterdir()) if repo.is_dir() else []
    targets = [p for p in targets if p.is_dir() or p.is_symlink()]
    if not targets:
        what = f"{model_id} (revision {revision})" if revision else model_id
        raise ModelNotFoundError(f"{what} is not in the model store {store}; `tgi-hpc models` lists what is there")
    for path in targets:
        if path.is_symlink():  # never follow a link out of the store
            path.unlink()
        else:
            shutil.rmtree(path)
    if repo.is_dir() and not any(repo.iterdir()):
        repo.rmdir()
    return targets


def resolve_model(spec: str, store: Path) -> Path:
    """The folder to serve for `spec`: a local model folder, or a Hub id `ORG/NAME[@REVISION]` in the store."""
    local = Path(spec).expanduser()
    if local.exists():
        if local.is_dir() and (local / "config.json").is_file():
            return local.resolve()
        raise ModelNotFoundError(f"{spec} exists but is not a model folder (it has no config.json)")
    if spec.startswith(("/", ".", "~")):
        raise ModelNotFoundError(f"model folder {spec} does not exist")
    model_id, _, revision = spec.partition("@")
    folder = model_dir(store, model_id, revision or "main")
    download = f"tgi-hpc download --model {model_id}" + (f" --revision {revision}" if revision else "")
    if not folder.is_dir():
        raise ModelNotFoundError(
            f"{spec} is not a local folder and is not in the model store {store}: run `{download}` first")
    if not read_stored_model(folder).complete:
        raise ModelNotFoundError(f"the download of {spec} in {folder} is incomplete: run `{download}` again")
    return folder


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """The manifest of a revision folder, or None if it is missing or unreadable."""
    try:
        data = json.loads((Path(folder) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(data, dict) and {"model_id", "revision", "files"} <= data.keys()
    return data if ok else None


def write_manifest(folder: Path, data: dict[str, Any]) -> Path:
    """Write the manifest atomically: it marks the download complete, so it must never be half written."""
    path = Path(folder) / MANIFEST
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=MANIFEST, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
    return path


def _has_size(path: Path, size: int) -> bool:
    try:
        return path.stat().st_size == size
    except OSError:
        return False


def _guess_format(folder: Path) -> str:
    for fmt in ("safetensors", "bin", "gguf"):
        if any(folder.glob(f"*.{fmt}")):
            return fmt
    return "unknown"


def stored_dict(m: StoredModel) -> dict:
    """A stored model as JSON-ready data (what `models --json` prints and the login-node helper returns)."""
    return {"model_id": m.model_id, "revision": m.revision, "size_bytes": m.size_bytes, "format": m.format,
            "complete": m.complete, "path": str(m.path), "kind": m.kind}
