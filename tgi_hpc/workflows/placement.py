"""How many GPUs and nodes a serve job takes: the profile's catalog for models that fit one node, the memory
arithmetic (weights + planned KV cache over the GPUs' usable memory) for larger ones, or the user's
--gpus / --nodes checked against the profile's multinode section. Every value is checked before submitting.

`--gpus` is the job's total: `--nodes 2 --gpus 8` is 4 GPUs on each of 2 nodes, and must divide evenly.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from tgi_hpc.errors import UsageError
from tgi_hpc.models.footprint import Footprint
from tgi_hpc.profiles.loader import resources_for
from tgi_hpc.profiles.schema import MultiNode, Profile, Resources


@dataclass(frozen=True)
class Placement:
    resources: Resources           # gpus = all nodes together, nodes = None or > 1
    nodes: int
    gpus_per_node: int
    notes: tuple[str, ...]         # the arithmetic behind the pick, written into the job script


def _where(profile: Profile) -> str:
    return profile.cluster or profile.name


def _need(profile: Profile, fp: Footprint | None, context_tokens: int | None) -> tuple[float | None, list[str]]:
    if fp is None:
        return None, []
    plan = profile.serving_plan
    context = context_tokens or plan.context_tokens
    kv = fp.kv_gb(context * plan.concurrent_requests)
    need = fp.weight_gb + kv
    if fp.pooling:  # prefill only: activations, no KV plan
        return need, [fp.describe(), f"needs {fp.weight_gb:.1f} GB weights, no KV cache (a pooling model)"]
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


def place(profile: Profile, fp: Footprint | None, size_b: float | None, gpus: int | None, nodes: int | None,
          num_heads: int | None = None, context_tokens: int | None = None) -> Placement:
    """The job's GPUs and nodes, with the arithmetic; UsageError for values the cluster cannot take."""
    if nodes is not None and nodes < 1:
        raise UsageError(f"--nodes must be at least 1, not {nodes}")
    need, notes = _need(profile, fp, context_tokens)
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
    total = gpus if gpus is not None else nodes * mn.gpus_per_node
    if total < nodes or total % nodes:
        raise UsageError(f"--gpus {total} is the job's total and must split evenly over --nodes {nodes} "
                         f"(e.g. --gpus {nodes * mn.gpus_per_node})")
    per_node = total // nodes
    if per_node > mn.gpus_per_node:
        raise UsageError(f"{_where(profile)}: {per_node} GPUs per node is more than a node has here "
                         f"({mn.gpus_per_node}; profile: multinode.gpus_per_node, source: {mn.source})")
    if num_heads and num_heads % per_node:
        raise UsageError(f"the model's {num_heads} attention heads do not split over {per_node} GPUs per node "
                         "(tensor parallelism runs within a node): pick a GPU count per node that divides them")
    base = resources_for(profile, "serve")
    res = base.model_copy(update={**mn.resources.model_dump(exclude_unset=True), "gpus": total,
                                  "nodes": nodes if nodes > 1 else None,
                                  "extra": {**base.extra, **mn.resources.extra}})
    usable = total * mn.gpu_memory_gb * profile.serving_plan.gpu_memory_fraction
    notes.append(f"{nodes} node(s) x {per_node} GPUs x {mn.gpu_memory_gb:g} GB x "
                 f"{profile.serving_plan.gpu_memory_fraction:g} usable = {usable:.0f} GB")
    if need and need > usable:
        notes.append(f"WARNING: {need:.0f} GB does not fit {usable:.0f} GB: lower --max-total-tokens, "
                     "quantize, or add nodes")
    return Placement(res, nodes, per_node, tuple(notes))
