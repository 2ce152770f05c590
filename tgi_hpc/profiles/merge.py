"""Merging profile layers (user file, TGI_HPC_ACCOUNT, --set, a cluster's overlay), remembering who set each key."""
from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from tgi_hpc.errors import ProfileError
from tgi_hpc.profiles.yaml_file import parse_yaml

Origins = dict[tuple, str]   # dotted key path -> where its value came from (file or --set item)


def merge(base: dict, over: Mapping, origin: str, origins: Origins, prefix: tuple = ()) -> dict:
    """Deep-merge `over` into a copy of `base`; mappings merge, everything else replaces."""
    out = dict(base)
    for key, value in over.items():
        path = (*prefix, key)
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(out[key], value, origin, origins, path)
        else:
            out[key] = copy.deepcopy(value)
            origins[path] = origin
    return out


def parse_set(item: str) -> tuple[tuple[str, ...], Any]:
    """A `--set KEY.PATH=VALUE` item as (key path, value parsed as YAML, else the literal string)."""
    key, sep, raw = item.partition("=")
    parts = tuple(key.strip().split("."))
    if not sep or not all(parts):
        raise ProfileError(f"--set {item!r}: expected KEY.PATH=VALUE, e.g. --set slurm.account=def-yourpi.")
    try:
        value = parse_yaml(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw                       # not YAML: keep it as the literal string
    return parts, value


def nest(parts: Sequence[str], value: Any) -> dict:
    """("a", "b"), 1 -> {"a": {"b": 1}}."""
    for part in reversed(parts):
        value = {part: value}
    return value


def apply_cluster(raw: dict, cluster: str, origins: Origins) -> dict:
    """Merge `clusters[cluster]` of the profile over its generic values, and record the cluster."""
    over = (raw.get("clusters") or {}).get(cluster)
    if not isinstance(over, Mapping):
        return {**raw, "cluster": cluster}
    # Cluster keys map onto profile keys (unknown ones are reported by validation, in place).
    where = {"login_host": ("login_host",), "cpu_login_host": ("cpu_login_host",), "detect": ("detect",),
             "gpu_request": ("slurm", "gpu_request"),
             "gpu_types": ("slurm", "gpu_types"),
             "gpu_memory_gb": ("slurm", "gpu_memory_gb"),
             "gpus_per_node": ("slurm", "gpus_per_node"), "access": ("access",), "allowed_gpu_counts": ("slurm", "allowed_gpu_counts"),
             "defaults": ("slurm", "defaults"),
             "catalog": ("catalog",), "network": ("network",), "modules": ("environment", "modules"),
             "env": ("environment", "env"), "paths": ("paths",), "rules": ("rules",),
             "multinode": ("multinode",)}
    for key, target in where.items():
        if over.get(key) is None or (target[0] == "slurm" and not isinstance(raw.get("slurm"), Mapping)):
            continue
        src = origin_of(origins, ("clusters", cluster, key))
        raw = merge(raw, nest(target, over[key]), f"{src} (via clusters.{cluster}.{key})", origins)
    return {**raw, "cluster": cluster}


def origin_of(origins: Origins, loc: Sequence, default: str = "") -> str:
    """Who set `loc`: the longest recorded prefix, or any recorded key below it."""
    for n in range(len(loc), 0, -1):
        if tuple(loc[:n]) in origins:
            return origins[tuple(loc[:n])]
    below = [src for path, src in origins.items() if path[: len(loc)] == tuple(loc)]
    return below[-1] if below else default
