"""Download a model from the Hugging Face Hub into the model store: only what serving needs, verified, resumable.

Files are fetched (4 at a time) with huggingface_hub's HEAD (`get_hf_file_metadata`) and GET (`http_get`) into
`<model_dir>/.tgi-hpc-partial/<path hash>.<oid>.part`, which the next run resumes with a Range request; huggingface_hub
>= 2.x downloads into a fresh uniquely-named temp file per process, so it cannot resume after a killed job.
Each file is checked against the Hub's tree listing (size, sha256 for LFS files, git blob sha1 otherwise)
before it is moved into place. The token stays in this process: it goes to huggingface_hub calls only, and
never to a redirect target on another host (the LFS CDN).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tgi_hpc import __version__
from tgi_hpc.errors import DownloadError
from tgi_hpc.models.adapter import ADAPTER_BIN, ADAPTER_CONFIG, base_model, is_adapter_repo, plan_adapter_files
from tgi_hpc.models.convert_bin import convert_bin_to_safetensors
from tgi_hpc.models.hf_token import find_token
from tgi_hpc.models.hub import Hub, HubFile, format_size
from tgi_hpc.models.store import (MANIFEST, PARTIAL_DIR, StoredModel, model_dir, read_manifest, read_stored_model,
                                 write_manifest)

logger = logging.getLogger(__name__)

# quantize_config.json: older AutoGPTQ exports keep GPTQ's settings there, not in config.json (serve sizes the
# job by it and the engine reads it). GPTQ/AWQ/compressed-tensors otherwise live in config.json itself.
_CONFIG_FILES = {"config.json", "generation_config.json", "quantize_config.json"}
_TOKENIZER_FILES = {"tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                    "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "chat_template.jinja",
                    "chat_template.json"}
_BIN_WEIGHTS = re.compile(r"pytorch_model(-\d+-of-\d+)?\.bin")
_EXTRA_TEMPLATES = re.compile(r"additional_chat_templates/[A-Za-z0-9_][^/]*\.jinja")
_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
# sentence-transformers: the module list, the pooling mode, max_seq_length and prompts (engine/pooling/spec.py)
_SENTENCE_TRANSFORMERS = {"modules.json", "sentence_bert_config.json", "config_sentence_transformers.json"}
_POOLING_CONFIG = re.compile(r"\d+_Pooling/config\.json")
_MAX_WORKERS = 4


def plan_files(repo_files: list[str]) -> list[str]:
    """The files serving needs: config, tokenizer and one copy of the weights (safetensors preferred).

    Only top-level files count (`original/` and other subfolders hold duplicates or other formats),
    except `additional_chat_templates/*.jinja` and a sentence-transformers `N_Pooling/config.json`. `.bin` weights are planned only when no safetensors exist.
    """
    top = [f for f in repo_files if "/" not in f]
    keep = {f for f in top if f in _CONFIG_FILES | _TOKENIZER_FILES or f.endswith(".tiktoken")}
    keep |= {f for f in repo_files if _EXTRA_TEMPLATES.fullmatch(f)}
    keep |= {f for f in top if f in _SENTENCE_TRANSFORMERS} | {f for f in repo_files if _POOLING_CONFIG.fullmatch(f)}
    return sorted(keep | set(_weight_files(top)))


def _weight_files(top: list[str]) -> list[str]:
    safetensors = [f for f in top if f.endswith(".safetensors")]
    if "model.safetensors" in safetensors:  # transformers prefers it over an index too
        return ["model.safetensors"]
    if safetensors:  # consolidated*.safetensors is Mistral's own-format duplicate of the HF shards
        shards = [f for f in safetensors if not f.startswith("consolidated")] or safetensors
        return shards + [i for i in _INDEXES[:1] if i in top]
    bins = [f for f in top if _BIN_WEIGHTS.fullmatch(f)]
    return bins + [i for i in _INDEXES[1:] if bins and i in top]


def download_model(model_id: str, store: Path, *, revision: str = "main", token: str | None = None,
                   endpoint: str | None = None, progress: bool = True, convert_bin: bool = True) -> StoredModel:
    """Download what serving needs of `model_id` into the store and return it; reruns resume or return early.

    `token=None` looks the token up with `find_token()`. Raises DownloadError with what to do.
    """
    folder = model_dir(store, model_id, revision)
    hub = Hub(model_id, endpoint, token if token is not None else find_token(), progress)
    commit, entries = hub.listing(revision)
    folder.mkdir(parents=True, exist_ok=True)
    with _locked(folder), _progress_bars(progress):
        old = read_manifest(folder)
        converting_later = convert_bin and old and old.get("format") == "bin"
        if old and old.get("commit") == commit and read_stored_model(folder).complete and not converting_later:
            logger.info("%s (%s) is already in %s", model_id, revision, folder)
            return read_stored_model(folder)
        (folder / MANIFEST).unlink(missing_ok=True)  # incomplete until the new manifest is written
        adapter = is_adapter_repo([p for p in entries if "/" not in p])
        fetch = _fetch_adapter if adapter else _fetch_and_convert
        records, fmt, converted = fetch(hub, commit, entries, folder, convert_bin)
        _remove_leftovers(folder, old, {r["path"] for r in records})
        write_manifest(folder, {
            "model_id": model_id, "revision": revision, "commit": commit, "format": fmt, "files": records,
            "kind": "adapter" if adapter else "model", **(_adapter_base(folder) if adapter else {}),
            "converted_from": converted, "endpoint": hub.origin, "tool": f"tgi-hpc {__version__}",
            "downloaded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        })
    logger.info("%s (%s, commit %s) is ready in %s", model_id, revision, commit[:12], folder)
    return read_stored_model(folder)


def _fetch_and_convert(hub: Hub, commit: str, entries: dict[str, HubFile], folder: Path,
                       convert_bin: bool) -> tuple[list[dict[str, Any]], str, list[str]]:
    plan = plan_files(list(entries))
    weights = _weight_files([p for p in plan if "/" not in p])
    if not [w for w in weights if w not in _INDEXES]:
        raise DownloadError(f"{hub.model_id} has no safetensors or PyTorch .bin weights at the top level "
                            f"(files: {', '.join(sorted(entries)[:20])}); tgi-hpc cannot serve it")
    records = _fetch_all(hub, commit, [entries[p] for p in plan if p not in weights or p in _INDEXES], folder)
    weights = _weights_from_index(folder, weights, entries, hub.model_id)
    _check_free_space(folder, [entries[w] for w in weights], convert_bin and weights[0].endswith(".bin"))
    records += _fetch_all(hub, commit, [entries[w] for w in weights], folder)
    if not any(w.endswith(".bin") for w in weights):
        return records, "safetensors", []
    if not convert_bin:
        return records, "bin", []
    bins = [r["path"] for r in records if r["path"].endswith(".bin") or r["path"] == _INDEXES[1]]
    outputs = convert_bin_to_safetensors(folder, [b for b in bins if b.endswith(".bin")])
    for name in bins:
        (folder / name).unlink()
    records = [r for r in records if r["path"] not in bins]
    return records + [_record(folder, name) for name in outputs], "safetensors", bins


def _fetch_adapter(hub: Hub, commit: str, entries: dict[str, HubFile], folder: Path,
                   convert_bin: bool) -> tuple[list[dict[str, Any]], str, list[str]]:
    """A PEFT adapter repo: its config and weights only (a few MB; no config.json or tokenizer needed)."""
    plan = plan_adapter_files(list(entries))
    if len(plan) < 2:
        raise DownloadError(f"{hub.model_id} has {ADAPTER_CONFIG} but no adapter_model.safetensors or "
                            f"{ADAPTER_BIN} at the top level (files: {', '.join(sorted(entries)[:20])})")
    records = _fetch_all(hub, commit, [entries[p] for p in plan], folder)
    if not plan[1].endswith(".bin"):
        return records, "safetensors", []
    if not convert_bin:
        return records, "bin", []
    outputs = convert_bin_to_safetensors(folder, [ADAPTER_BIN])
    (folder / ADAPTER_BIN).unlink()
    return [records[0]] + [_record(folder, name) for name in outputs], "safetensors", [ADAPTER_BIN]


def _adapter_base(folder: Path) -> dict[str, str]:
    try:
        base = base_model(json.loads((folder / ADAPTER_CONFIG).read_text()))
    except (OSError, ValueError, AttributeError) as e:
        raise DownloadError(f"{ADAPTER_CONFIG} in {folder} is not valid JSON ({e})") from e
    return {"base_model": base} if base else {}


def _weights_from_index(folder: Path, weights: list[str], entries: dict[str, HubFile], model_id: str) -> list[str]:
    """Use the shards an index names (and only those) when the repo has an index."""
    index = next((i for i in _INDEXES if i in weights), None)
    if index is None:
        return weights
    try:
        shards = sorted(set(json.loads((folder / index).read_text())["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise DownloadError(f"{index} of {model_id} is not a valid weight index ({e})") from e
    missing = [s for s in shards if s not in entries or "/" in s]
    if missing or not shards:
        raise DownloadError(f"{index} of {model_id} names shards that are not in the repo: {', '.join(missing)}")
    return shards


def _fetch_all(hub: Hub, commit: str, entries: list[HubFile], folder: Path) -> list[dict[str, Any]]:
    if not entries:
        return []
    pool = ThreadPoolExecutor(max_workers=min(_MAX_WORKERS, len(entries)))
    try:
        futures = [pool.submit(_fetch_file, hub, commit, e, folder) for e in entries]
        return [f.result() for f in futures]
    finally:  # on an error or Ctrl-C, start nothing new; files in flight finish (and stay resumable)
        pool.shutdown(wait=True, cancel_futures=True)


def _fetch_file(hub: Hub, commit: str, entry: HubFile, folder: Path) -> dict[str, Any]:
    """Fetch one file (resuming a partial one), verify it and move it into place."""
    if entry.path.startswith("/") or ".." in entry.path.split("/"):  # only a hostile endpoint would list these
        raise DownloadError(f"{hub.base} listed an unsafe file name for {hub.model_id}: {entry.path!r}")
    dest = folder / entry.path
    if dest.is_file() and (sha256 := _verified_sha256(dest, entry)):
        return {"path": entry.path, "size": entry.size, "sha256": sha256}
    # named by path and content: identical files may download in parallel, a new commit does not reuse a part
    key = hashlib.sha1(entry.path.encode()).hexdigest()[:16]
    part = folder / PARTIAL_DIR / f"{key}.{entry.sha256 or entry.blob_id}.part"
    part.parent.mkdir(parents=True, exist_ok=True)
    if part.exists() and part.stat().st_size > entry.size:
        part.unlink()
    resume = part.stat().st_size if part.exists() else 0
    if resume:
        logger.info("resuming %s at %d of %d bytes", entry.path, resume, entry.size)
    hub.get(commit, entry, part, resume)
    sha256 = _verified_sha256(part, entry)
    if sha256 is None:
        got = part.stat().st_size
        part.unlink()
        expected = f"sha256 {entry.sha256}" if entry.sha256 else f"git oid {entry.blob_id}"
        raise DownloadError(f"{entry.path} of {hub.model_id} is corrupt after download ({got} bytes, expected "
                            f"{entry.size} with {expected}); the partial file was deleted: run the download again")
    dest.parent.mkdir(parents=True, exist_ok=True)
    os.replace(part, dest)
    logger.info("fetched %s (%d bytes)", entry.path, entry.size)
    return {"path": entry.path, "size": entry.size, "sha256": sha256}


def _verified_sha256(path: Path, entry: HubFile) -> str | None:
    """The file's sha256 if it matches the Hub's size and hash (sha256 for LFS, git blob sha1 otherwise)."""
    if path.stat().st_size != entry.size:
        return None
    sha256, blob = _hashes(path)
    return sha256 if (sha256 == entry.sha256 if entry.sha256 else blob == entry.blob_id) else None


def _hashes(path: Path) -> tuple[str, str]:
    """(sha256, git blob sha1) of a file, in one read."""
    sha256, blob = hashlib.sha256(), hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            sha256.update(chunk)
            blob.update(chunk)
    return sha256.hexdigest(), blob.hexdigest()


def _record(folder: Path, name: str) -> dict[str, Any]:
    return {"path": name, "size": (folder / name).stat().st_size, "sha256": _hashes(folder / name)[0]}


def _check_free_space(folder: Path, weights: list[HubFile], converting: bool) -> None:
    missing = [e for e in weights if not (folder / e.path).is_file()]
    needed = sum(e.size for e in missing) + (max(e.size for e in weights) if converting else 0)
    free = shutil.disk_usage(folder).free
    if needed > free:
        raise DownloadError(f"not enough disk space in {folder}: the download needs {format_size(needed)}, "
                            f"{format_size(free)} are free; free some space or use another model store")


def _remove_leftovers(folder: Path, old_manifest: dict[str, Any] | None, keep: set[str]) -> None:
    """Drop the partial folder and files of a previous commit that the new one no longer has."""
    shutil.rmtree(folder / PARTIAL_DIR, ignore_errors=True)
    for record in (old_manifest or {}).get("files", []):
        path = folder / record["path"]
        if record["path"] not in keep and path.resolve().is_relative_to(folder.resolve()):
            path.unlink(missing_ok=True)


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """One download per model folder at a time: a second job waits, then finds the work done."""
    import fcntl

    with open(folder / ".tgi-hpc.lock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another download into %s", folder)
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError as e:  # some parallel file systems have no flock; go on unlocked
            logger.warning("cannot lock %s (%s); do not run two downloads of this model at once", folder, e)
        yield


@contextlib.contextmanager
def _progress_bars(enabled: bool) -> Iterator[None]:
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    if enabled or are_progress_bars_disabled():
        yield
        return
    disable_progress_bars()
    try:
        yield
    finally:
        enable_progress_bars()
