"""Checks `serve` makes before submitting, so a job never fails on its node after the queue wait for a
cause we could see here: the engine release, a complete snapshot, and a read-only shared copy of the weights."""
from __future__ import annotations

import json
import logging
import posixpath

from tgi_hpc import __version__
from tgi_hpc.errors import ModelNotFoundError, ReleaseError
from tgi_hpc.quoting import sh
from tgi_hpc.slurm.cluster import Cluster

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ({"tokenizer.json"}, {"tokenizer.model"}, {"vocab.json", "merges.txt"}, {"tiktoken.model"})
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def _listing(cluster: Cluster, path: str) -> set[str] | None:
    result = cluster.runner.run(["ls", "-1A", path])
    return set(result.stdout.split("\n")) - {""} if result.returncode == 0 else None


def snapshot_problems(cluster: Cluster, path: str) -> list[str]:
    """What a serve job would miss in the snapshot at `path` (read where the jobs run); [] when complete."""
    names = _listing(cluster, path)
    if names is None:
        return [f"{path} does not exist"]
    if "config.json" not in names and "adapter_config.json" in names:
        return ["it holds a PEFT adapter, not a model: serve its base model with --lora NAME=ADAPTER"]
    problems = [] if "config.json" in names else ["config.json is missing"]
    if not any(group <= names for group in TOKENIZER_FILES):
        problems.append("no tokenizer (tokenizer.json, tokenizer.model, or vocab.json + merges.txt)")
    weights = {n for n in names if n.endswith(WEIGHT_SUFFIXES)}
    if not weights:
        problems.append("no weight files (*.safetensors)")
    for index in sorted(n for n in names if n.endswith(".index.json")):
        try:
            shards = set(json.loads(cluster.runner.read_file(posixpath.join(path, index)))["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            problems.append(f"{index} is unreadable")
            continue
        missing = sorted(shards - names)
        if missing:
            problems.append(f"{len(missing)} of {len(shards)} shards named in {index} are missing (e.g. {missing[0]})")
    return problems


def check_snapshot(cluster: Cluster, path: str, model: str, in_store: bool) -> None:
    problems = snapshot_problems(cluster, path)
    if not problems:
        return
    if in_store and problems == [f"{path} does not exist"]:
        raise ModelNotFoundError(f"{model} is not in the model store ({path}): "
                                 f"run `tgi-hpc download --model {sh(model)}` first")
    again = f"; run `tgi-hpc download --model {sh(model)}` again (it resumes)" if in_store else ""
    raise ModelNotFoundError(f"the snapshot at {path} is incomplete: {'; '.join(problems)}{again}")


def check_release(cluster: Cluster, path: str, explicit: bool) -> None:
    """The engine release the job activates must exist (a venv: bin/python); one built for another tgi-hpc
    version is a warning (the job runs the release's engine and job helper, not this CLI's)."""
    if cluster.runner.run(["test", "-x", f"{path.rstrip('/')}/bin/python"]).returncode == 0:
        if (version := release_version(cluster, path)) and version != __version__:
            logger.warning("release %s holds tgi-hpc %s, this CLI is %s: rebuild it with `tgi-hpc compile`",
                           path, version, __version__)
        return
    hint = "check --release" if explicit else "build one with `tgi-hpc compile` (once per cluster), or pass --release DIR"
    raise ReleaseError(f"no engine release at {path} (no bin/python): {hint}")


def release_version(cluster: Cluster, path: str) -> str:
    """The tgi-hpc version a release installed (its release.json; "" when unknown)."""
    from tgi_hpc.release.manifest import MANIFEST

    try:
        return str(json.loads(cluster.runner.read_file(posixpath.join(path, MANIFEST))).get("tgi_hpc_version") or "")
    except (OSError, ValueError, AttributeError):
        return ""


def find_shared_weights(cluster: Cluster, model: str, roots: list[str]) -> str | None:
    """A complete snapshot of `model` under the profile's read-only weight folders (Mila: /network/weights),
    found by its name (ORG/NAME -> a folder NAME, any case, up to 3 levels down); None when there is none."""
    name = model.rsplit("/", 1)[-1]
    for root in roots:
        # find exits 1 on unreadable (restricted) folders but still prints what it found
        result = cluster.runner.run(["find", root, "-maxdepth", "3", "-type", "d", "-iname", name])
        for candidate in sorted(result.stdout.split("\n")):
            if candidate and not snapshot_problems(cluster, candidate):
                return candidate
    return None
