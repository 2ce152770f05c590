"""`tgi-hpc list [MODEL]`: what this cluster's profile serves with which resources, what is ready to serve
(the read-only shared weights, Mila's /network/weights, and the model store), and for one model what `serve`
would ask for and why."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from tgi_hpc.errors import SlurmError, UsageError
from tgi_hpc.models.size import catalog_size_b
from tgi_hpc.profiles.loader import resources_for
from tgi_hpc.profiles.rules import check_job
from tgi_hpc.slurm.cluster import Cluster
from tgi_hpc.workflows.checks import snapshot_problems
from tgi_hpc.workflows.prepare import list_stored
from tgi_hpc.workflows.serve import ServeOptions, build_serve_spec


@dataclass
class CatalogRow:
    """One catalog entry with the serve defaults under it: what a model up to `max_params_b` gets."""

    label: str
    max_params_b: float
    gpus: int | None
    gpu_type: str | None
    constraint: str | None
    partition: str | None
    time: str | None
    cpus_per_task: int | None
    mem: str | None


@dataclass
class ReadyModel:
    """A snapshot serve can use: `where` is "shared" (read-only, no download) or "store"."""

    name: str
    path: str
    where: str
    complete: bool


@dataclass
class Listing:
    profile: str
    cluster: str | None
    catalog: list[CatalogRow]
    ready: list[ReadyModel]
    shared_roots: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def catalog_rows(cluster: Cluster) -> list[CatalogRow]:
    profile = cluster.profile
    rows = []
    for entry in sorted(profile.catalog, key=lambda e: e.max_params_b):
        res = resources_for(profile, "serve", entry.max_params_b)
        rows.append(CatalogRow(entry.label, entry.max_params_b, res.gpus, res.gpu_type, res.constraint,
                               res.partition, res.time, res.cpus_per_task, res.mem))
    return rows


def shared_models(cluster: Cluster) -> list[ReadyModel]:
    """Every folder with a config.json under the profile's shared weight folders, at the depths `serve` looks."""
    found = []
    for root in cluster.profile.paths.shared_weights:
        # find exits 1 on unreadable (restricted) folders but still prints what it found
        result = cluster.runner.run(["find", root, "-maxdepth", "4", "-name", "config.json"], timeout=120)
        for config in sorted(set(result.stdout.split("\n")) - {""}):
            path = config[: -len("/config.json")]
            found.append(ReadyModel(path.rsplit("/", 1)[-1], path, "shared", not snapshot_problems(cluster, path)))
    return found


def list_models(cluster: Cluster) -> Listing:
    stored = [ReadyModel(m["model_id"] + ("" if m["revision"] == "main" else f"@{m['revision']}"), m["path"], "store",
                         m["complete"]) for m in list_stored(cluster) if m.get("kind") != "adapter"]
    return Listing(cluster.profile.name, cluster.profile.cluster, catalog_rows(cluster), shared_models(cluster) + stored,
                   list(cluster.profile.paths.shared_weights))


@dataclass
class ServePlan:
    """What `serve --model MODEL` would ask Slurm for, and why."""

    model: str
    path: str
    where: str                  # "shared", "store", "path"
    ready: bool
    problems: list[str]
    size_b: float | None
    catalog_entry: str | None   # the entry that sized it (None: beyond the catalog, or no catalog)
    resources: dict
    nodes: int
    tensor_parallel: int
    why: list[str]
    refused: str | None         # the cluster's rule that serve would refuse this job by (its page cited)
    next_step: str

    def to_dict(self) -> dict:
        return asdict(self)


def plan_serve(cluster: Cluster, model: str) -> ServePlan:
    spec = build_serve_spec(cluster, ServeOptions(model=model))
    paths = cluster.profile.paths
    where = "store" if spec.model_dir.base == paths.models else (
        "shared" if any(spec.model_dir.rel.startswith(root.rstrip("/") + "/") for root in paths.shared_weights)
        else "path")
    path = cluster.expand(str(spec.model_dir))
    problems = snapshot_problems(cluster, path)
    size = catalog_size_b(model, _config(cluster, path))
    entries = sorted(cluster.profile.catalog, key=lambda e: e.max_params_b)
    entry = next((e for e in entries if size is not None and e.max_params_b >= size), None)
    why = ([f"catalog entry {entry.label} (models up to {entry.max_params_b:g}B at 2 bytes a parameter)"]
           if entry else []) + list(spec.sizing)
    try:
        check_job(cluster.profile, spec.resources)
        refused = None
    except UsageError as e:
        refused = str(e)
    if refused:
        step = "serve with the options the refusal names"
    elif not problems:
        step = f"tgi-hpc serve --model {model} --wait"
    elif where == "store":
        step = (f"tgi-hpc download --model {model} --wait (a gated model: accept its licence on its Hub page "
                "first, and set HF_TOKEN)")
    else:
        step = f"fix the snapshot at {path}: " + "; ".join(problems)
    res = spec.resources.model_dump(exclude_none=True, exclude={"extra"})
    return ServePlan(model, path, where, not problems, problems, size, entry.label if entry else None, res,
                     spec.nodes, spec.num_shard, why, refused, step)


def _config(cluster: Cluster, path: str) -> dict | None:
    try:
        config = json.loads(cluster.runner.read_file(f"{path}/config.json"))
    except (OSError, ValueError, SlurmError):
        return None
    return config if isinstance(config, dict) else None
