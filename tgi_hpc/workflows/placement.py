"""How many GPUs and nodes a serve job takes: the profile's catalog for models that fit one node, the memory
arithmetic (weights + planned KV cache over the GPUs' usable memory) for larger ones, or the user's
--gpus / --nodes checked against the profile's multinode section. Every value is checked before submitting.

`--gpus` is the job's total: `--nodes 2 --gpus 8` is 4 GPUs on each of 2 nodes, and must divide evenly.
`--gpu-type` picks one of the cluster's GPU types; the job is then sized from that type's memory
(profile: slurm.gpu_memory_gb) instead of the catalog, which is for the cluster's default type.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from tgi_hpc.errors import UsageError
from tgi_hpc.models.footprint import Footprint
from tgi_hpc.profiles.loader import resources_for
from tgi_hpc.profiles.rules import allowed_count, check_gpu_type
from tgi_hpc.profiles.schema import MultiNode, Profile, Resources

# Ours: a model known only by its name (no config.json here, not in tgi_hpc/models/known_models.py) has no
# layer shapes to size its KV cache from, so the cache is planned as this share of the weights.
KV_SHARE_UNKNOWN = 0.3


@dataclass(frozen=True)
class Placement:
    resources: Resources           # gpus = all nodes together, nodes = None or > 1
    nodes: int
    gpus_per_node: int
    notes: tuple[str, ...]         # the arithmetic behind the pick, written into the job script


def _where(profile: Profile) -> str:
    return profile.cluster or profile.name


def _need(profile: Profile, fp: Footprint | None, context_tokens: int | None,
          size_b: float | None = None) -> tuple[float | None, list[str]]:
    if fp is None:
        if not size_b:
            return None, []
        weights = 2 * size_b
        kv = KV_SHARE_UNKNOWN * weights
        return weights + kv, [f"needs {weights:.0f} GB weights (size from the name) + {kv:.0f} GB KV cache "
                              f"({KV_SHARE_UNKNOWN:g} of the weights: no layer shapes here) = {weights + kv:.0f} GB"]
    plan = profile.serving_plan
    context = context_tokens or plan.context_tokens
    kv = fp.kv_gb(context * plan.concurrent_requests)
    need = fp.weight_gb + kv
    return need, [fp.describe(),
                  f"needs {fp.weight_gb:.0f} GB weights + {kv:.1f} GB KV cache ({context} tokens x "
                  f"{plan.concurrent_requests} requests) = {need:.0f} GB of GPU memory"]


def _beyond_catalog(profile: Profile, size_b: float | None) -> bool:
    return bool(size_b and profile.catalog and size_b > max(e.max_params_b for e in profile.catalog))


def _multinode(profile: Profile, nodes: int) -> MultiNode:
    if profile.multinode is None:
        raise UsageError(f"{_where(profile)}: serve jobs stay on one node here (the profile has no multinode "
                         f"section); --nodes {nodes} is refused")
    if nodes > profile.multinode.max_nodes:
        raise UsageError(f"{_where(profile)}: a serve job spans at most {profile.multinode.max_nodes} nodes, not "
                         f"{nodes} (profile: multinode.max_nodes; source: {profile.multinode.source})")
    return profile.multinode


def _auto_nodes(profile: Profile, need: float) -> int:
    mn, fraction = profile.multinode, profile.serving_plan.gpu_memory_fraction
    gpus = math.ceil(need / (mn.gpu_memory_gb * fraction))
    nodes = math.ceil(gpus / mn.gpus_per_node)
    if nodes > mn.max_nodes:
        raise UsageError(f"{_where(profile)}: {need:.0f} GB needs {gpus} GPUs of {mn.gpu_memory_gb:g} GB "
                         f"({nodes} nodes), more than the {mn.max_nodes} nodes a job may span; quantize "
                         f"(--quantize fp8) or pass --nodes/--gpus yourself (source: {mn.source})")
    return nodes


def _per_node(profile: Profile, gpu_type: str) -> int | None:
    """GPUs of `gpu_type` in one node, where the profile says (whole-node rule, slurm.gpus_per_node, or its
    multinode section)."""
    rule = profile.rules.whole_nodes
    if rule and gpu_type in rule.gpus_per_node:
        return rule.gpus_per_node[gpu_type]
    if profile.slurm and gpu_type in profile.slurm.gpus_per_node:
        return profile.slurm.gpus_per_node[gpu_type]
    mn = profile.multinode
    return mn.gpus_per_node if mn and mn.resources.gpu_type == gpu_type else None


def _shardable(profile: Profile, gpu_type: str, count: int, num_heads: int | None) -> int:
    """The smallest count at least `count` that the cluster allows and tensor parallelism can use: one that
    divides the attention heads, or a power of two when their number is unknown."""
    while True:
        count = allowed_count(profile, gpu_type, count)
        fits = num_heads % count == 0 if num_heads else count & (count - 1) == 0
        if fits or count > 1024:
            return count
        count += 1


def _typed(profile: Profile, gpu_type: str, need: float | None, size_b: float | None, gpus: int | None,
           notes: list[str], num_heads: int | None = None) -> Placement:
    """One node of `gpu_type` GPUs: --gpus, else as many as `need` takes of that type's memory."""
    if gpus is None and need:
        memory = profile.slurm.gpu_memory_gb.get(gpu_type) if profile.slurm else None
        if memory is None:
            raise UsageError(f"{_where(profile)}: the profile gives no memory for GPU type {gpu_type!r} (profile: "
                             "slurm.gpu_memory_gb), so the job cannot be sized from it: pass --gpus")
        fraction = profile.serving_plan.gpu_memory_fraction
        gpus = _shardable(profile, gpu_type, math.ceil(need / (memory * fraction)), num_heads)
        notes.append(f"--gpu-type {gpu_type}: {gpus} x {memory:g} GB x {fraction:g} usable = "
                     f"{gpus * memory * fraction:.0f} GB")
        per_node = _per_node(profile, gpu_type)
        if per_node and gpus > per_node:
            raise UsageError(f"{_where(profile)}: {need:.0f} GB needs {gpus} {gpu_type} GPUs, more than one node's "
                             f"{per_node}: pass --nodes and --gpus, or quantize (--quantize fp8)")
    elif gpus is None:
        gpus = allowed_count(profile, gpu_type, resources_for(profile, "serve").gpus or 1)
    res = resources_for(profile, "serve", size_b, gpus)
    update: dict = {"gpu_type": gpu_type}
    if res.gpu_type != gpu_type:
        update["constraint"] = None       # a catalog entry's node features are for its own GPU type
    res = res.model_copy(update=update)
    return Placement(res, 1, res.gpus or 0, tuple(notes + [f"one node, {res.gpus} {gpu_type} GPU(s)"]))


def place(profile: Profile, fp: Footprint | None, size_b: float | None, gpus: int | None, nodes: int | None,
          num_heads: int | None = None, context_tokens: int | None = None, gpu_type: str | None = None) -> Placement:
    """The job's GPUs and nodes, with the arithmetic; UsageError for values the cluster cannot take."""
    if nodes is not None and nodes < 1:
        raise UsageError(f"--nodes must be at least 1, not {nodes}")
    if gpu_type is not None:
        check_gpu_type(profile, gpu_type)
    need, notes = _need(profile, fp, context_tokens, size_b)
    if gpu_type is not None and (nodes or 1) == 1:
        return _typed(profile, gpu_type, need, size_b, gpus, notes, num_heads)
    auto = nodes is None and gpus is None and bool(need) and _beyond_catalog(profile, size_b) \
        and profile.multinode is not None
    if auto:
        nodes = _auto_nodes(profile, need)
        notes.append(f"larger than the catalog's largest entry: {nodes} node(s) of "
                     f"{profile.multinode.gpus_per_node} x {profile.multinode.gpu_memory_gb:g} GB")
    elif (nodes or 1) == 1:
        res = resources_for(profile, "serve", size_b, gpus)
        return Placement(res, 1, res.gpus or 0, tuple(notes + [f"one node, {res.gpus or 0} GPU(s)"]))
    mn = _multinode(profile, nodes) if nodes > 1 else profile.multinode
    # a named GPU type has its own node size where the profile gives one (Trillium: 4 x H100, 8 x B200)
    node_gpus = (_per_node(profile, gpu_type) if gpu_type else None) or mn.gpus_per_node
    memory = (profile.slurm.gpu_memory_gb.get(gpu_type) if gpu_type and profile.slurm else None) or mn.gpu_memory_gb
    total = gpus if gpus is not None else nodes * node_gpus
    if total < nodes or total % nodes:
        raise UsageError(f"--gpus {total} is the job's total and must split evenly over --nodes {nodes} "
                         f"(e.g. --gpus {nodes * node_gpus})")
    per_node = total // nodes
    if per_node > node_gpus:
        raise UsageError(f"{_where(profile)}: {per_node} GPUs per node is more than a node has here "
                         f"({node_gpus}; profile: multinode.gpus_per_node, source: {mn.source})")
    if num_heads and num_heads % per_node:
        raise UsageError(f"the model's {num_heads} attention heads do not split over {per_node} GPUs per node "
                         "(tensor parallelism runs within a node): pick a GPU count per node that divides them")
    base = resources_for(profile, "serve")
    res = base.model_copy(update={**mn.resources.model_dump(exclude_unset=True), "gpus": total,
                                  "nodes": nodes if nodes > 1 else None,
                                  "extra": {**base.extra, **mn.resources.extra},
                                  **({"gpu_type": gpu_type} if gpu_type else {}),
                                  # the section's node features are for its own GPU type
                                  **({"constraint": None} if gpu_type and gpu_type != mn.resources.gpu_type else {})})
    usable = total * memory * profile.serving_plan.gpu_memory_fraction
    notes.append(f"{nodes} node(s) x {per_node} GPUs x {memory:g} GB x "
                 f"{profile.serving_plan.gpu_memory_fraction:g} usable = {usable:.0f} GB")
    if need and need > usable:
        notes.append(f"WARNING: {need:.0f} GB does not fit {usable:.0f} GB: lower --max-total-tokens, "
                     "quantize, or add nodes")
    return Placement(res, nodes, per_node, tuple(notes))
