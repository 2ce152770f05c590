"""`serve --lora NAME=ORG/ADAPTER` (or NAME=FOLDER): resolve each adapter where the jobs run, check its name and
its base model, and attach it to the model it was trained on.

With one model every adapter goes to it; an adapter whose recorded base looks like another model is a warning
(the engine refuses shapes that do not fit, at start). With several models each adapter goes to the model its
`base_model_name_or_path` names; none or several is refused in one line, before anything is submitted.
"""
from __future__ import annotations

import json
import logging
import posixpath
from dataclasses import dataclass
from collections.abc import Callable
from pathlib import Path

from tgi_hpc.errors import ModelNotFoundError, SlurmError, UsageError
from tgi_hpc.models.adapter import ADAPTER_CONFIG, adapter_problems, base_model, check_adapter_name, same_base
from tgi_hpc.models.store import model_dir, validate_model_id
from tgi_hpc.quoting import sh
from tgi_hpc.remote.runner import LocalRunner
from tgi_hpc.slurm.cluster import Cluster
from tgi_hpc.slurm.jobspec import LoraAdapter, ShellPath

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Adapter:
    spec: LoraAdapter
    base: str | None        # its base_model_name_or_path, when it could be read
    unread: bool = False    # a dry run from a laptop reads nothing on the cluster


def parse_lora(item: str) -> tuple[str, str]:
    """"NAME=ORG/ADAPTER" or "NAME=/path" -> (name, source), refusing what the engine could not serve."""
    name, sep, source = item.partition("=")
    if not sep or not source:
        raise UsageError(f"--lora {item!r}: expected NAME=ORG/ADAPTER or NAME=FOLDER")
    try:
        check_adapter_name(name)
    except ValueError as exc:
        raise UsageError(f"--lora {item!r}: {exc}") from None
    return name, source


def _location(cluster: Cluster, source: str, cluster_path: Callable[[Cluster, str], str]) -> ShellPath:
    local = isinstance(cluster.runner, LocalRunner) and Path(source).expanduser().is_dir()
    if source.startswith(("/", ".", "~")) or local:
        path = cluster_path(cluster, source)
        if "," in path:   # the engine's flag is name=path,name2=path2
            raise UsageError(f"--lora folder {path!r}: a ',' cannot be passed to the engine; rename or link it")
        return ShellPath("", path)
    model_id, _, revision = source.partition("@")
    rel = model_dir(Path("/"), validate_model_id(model_id), revision or "main").relative_to("/")
    return ShellPath(cluster.profile.paths.models, str(rel))


def _read_base(cluster: Cluster, where: ShellPath, offline: bool) -> str | None:
    if offline and not cluster.is_local:
        return None
    try:
        config = json.loads(cluster.runner.read_file(posixpath.join(cluster.expand(str(where)), ADAPTER_CONFIG)))
    except (OSError, ValueError, SlurmError):
        return None
    return base_model(config) if isinstance(config, dict) else None


def resolve_adapters(cluster: Cluster, items: list[str], taken: set[str], cluster_path: Callable[[Cluster, str], str],
                     offline: bool = False) -> list[Adapter]:
    """Every --lora, resolved; `taken`: the served model names, which an adapter may not reuse;
    `cluster_path`: a folder given here -> its absolute path where the jobs run."""
    found: list[Adapter] = []
    for item in items:
        name, source = parse_lora(item)
        if name in taken or any(a.spec.name == name for a in found):
            raise UsageError(f"--lora {item!r}: the name {name!r} is already served; give each adapter its own name")
        where = _location(cluster, source, cluster_path)
        unread = offline and not cluster.is_local
        found.append(Adapter(LoraAdapter(name, source, where), _read_base(cluster, where, offline), unread))
    return found


def attach(adapters: list[Adapter], models: list[str]) -> list[tuple[LoraAdapter, ...]]:
    """The adapters of each model, in the models' order (see the module docstring for the rule)."""
    per_model: list[list[LoraAdapter]] = [[] for _ in models]
    for adapter in adapters:
        if len(models) == 1 or adapter.unread:
            if adapter.unread and len(models) > 1:
                logger.warning("dry run: adapter %s is not read from the cluster, shown with %s", adapter.spec.name,
                               models[0])
            if adapter.base and not same_base(adapter.base, models[0]):
                logger.warning("adapter %s was trained on %s, not on %s: the engine refuses it at start if its "
                               "shapes do not fit", adapter.spec.name, adapter.base, models[0])
            per_model[0].append(adapter.spec)
            continue
        fits = [i for i, model in enumerate(models) if adapter.base and same_base(adapter.base, model)]
        if len(fits) != 1:
            base = f"was trained on {adapter.base}" if adapter.base else "names no base model"
            which = "several of" if fits else "none of"
            raise UsageError(f"--lora {adapter.spec.name}: the adapter {base}, which matches {which} the served "
                             f"models ({', '.join(models)}); serve it in a job with its base model")
        per_model[fits[0]].append(adapter.spec)
    return [tuple(group) for group in per_model]


def check_adapters(cluster: Cluster, adapters: tuple[LoraAdapter, ...]) -> None:
    """Each adapter folder is complete where the job will look (else the job fails after the queue)."""
    for adapter in adapters:
        path = cluster.expand(str(adapter.where))
        result = cluster.runner.run(["ls", "-1A", path])
        in_store = adapter.where.base == cluster.profile.paths.models
        if result.returncode != 0:
            hint = f": run `tgi-hpc download --model {sh(adapter.source)}` first" if in_store else ""
            raise ModelNotFoundError(f"adapter {adapter.name}: {path} does not exist{hint}")
        problems = adapter_problems(set(result.stdout.split("\n")) - {""})
        if problems:
            hint = f"; run `tgi-hpc download --model {sh(adapter.source)}` again" if in_store else ""
            raise ModelNotFoundError(f"adapter {adapter.name} at {path} is incomplete: {'; '.join(problems)}{hint}")
