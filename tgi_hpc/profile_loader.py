"""Load cluster profiles: find, read, merge and validate them against the schema in tgi_hpc.profile.

Merge order (later wins), then one validation against the schema:

1. the base: the built-in ``local`` dict, a shipped ``profiles/<name>.yaml``, or an explicit file;
2. ``clusters[<cluster>]`` of that profile applied over it (cluster from the name, e.g. ``narval``,
   the ``cluster=`` argument, or login-node detection; none applied = the profile's generic values);
   ``clusters`` entries from steps 3-5 are merged in first, so a user may edit a cluster too;
3. the user file ``<user_config_dir>/<name>.yaml``, deep-merged (mappings merge, lists replace);
4. ``TGI_HPC_ACCOUNT`` fills ``slurm.account``;
5. ``--set key.path=value`` overrides, values parsed as YAML (``--set slurm.defaults.serve.gpus=2``).

Any error names the file (or ``--set`` item) and the dotted key that caused it.
"""
from __future__ import annotations

import copy
import difflib
import fnmatch
import os
import re
import socket
import types
import typing
import unicodedata
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from tgi_hpc.data import data_dir
from tgi_hpc.errors import ProfileError
from tgi_hpc.profile import JobKind, Profile, Resources


# --- where profiles live ---------------------------------------------------------------------

def profile_dirs() -> list[Path]:
    """Shipped profile folders: the wheel's tgi_hpc/_data/profiles, else <repo>/profiles."""
    try:
        return [data_dir("profiles")]
    except FileNotFoundError:
        return []


def user_config_dir(env: Mapping[str, str] | None = None) -> Path:
    """Per-user profile overrides: $TGI_HPC_CONFIG_DIR, else the platform's config dir."""
    env = os.environ if env is None else env
    if env.get("TGI_HPC_CONFIG_DIR"):
        return Path(env["TGI_HPC_CONFIG_DIR"]).expanduser()
    import platformdirs

    return Path(platformdirs.user_config_dir("tgi-hpc"))


def _shipped() -> dict[str, Path]:
    return {p.stem: p for d in profile_dirs() for p in sorted(d.glob("*.yaml"))}


def list_profiles(env: Mapping[str, str] | None = None) -> list[str]:
    """`local`, then shipped profiles, then user profiles that are not overlays of shipped ones."""
    names = ["local", *sorted(_shipped())]
    user_dir = user_config_dir(env)
    user = sorted(p.stem for p in user_dir.glob("*.yaml")) if user_dir.is_dir() else []
    return names + [n for n in user if n not in names]


def _local_profile(env: Mapping[str, str]) -> dict[str, Any]:
    # No Slurm: everything runs on this machine, under the user's data/cache dirs.
    data = env.get("XDG_DATA_HOME")
    base = str(Path(data) / "tgi-hpc") if data else str(Path("~/.cache/tgi-hpc").expanduser())
    return {
        "name": "local",
        "description": "This machine, without Slurm (development and tests).",
        "paths": {"scratch": base, "models": f"{base}/models", "releases": f"{base}/releases",
                  "jobs": f"{base}/jobs", "node_local": f"{base}/tmp"},
        "network": {"compute_nodes_internet": True, "download_on": "login", "compile_on": "login"},
    }


# --- YAML reading ----------------------------------------------------------------------------

class _UniqueKeyLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """SafeLoader that rejects duplicate keys (PyYAML silently keeps the last one)."""


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    loader.flatten_mapping(node)
    mapping: dict[Any, Any] = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            duplicate = key in mapping
        except TypeError:
            raise yaml.constructor.ConstructorError(
                None, None, "a key must be a plain scalar", key_node.start_mark) from None
        if duplicate:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark)
        mapping[key] = loader.construct_object(value_node, deep=deep)
    return mapping


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
# YAML 1.1 reads 1:00:00 as the base-60 integer 3600; a Slurm time must stay a string.
_BASE60 = re.compile(r"^[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?$")
_UniqueKeyLoader.add_implicit_resolver("tag:yaml.org,2002:str", _BASE60, list("-+0123456789"))
for _first in "-+0123456789":
    _rules = _UniqueKeyLoader.yaml_implicit_resolvers[_first]
    _rules.insert(0, _rules.pop())   # checked before the int/float rules


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ProfileError(f"{path}: cannot read profile ({e.strerror or e}).") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise ProfileError(f"{where}: invalid YAML: {e.problem or e.context}. Fix the file.") from None
    except yaml.YAMLError as e:
        raise ProfileError(f"{path}: invalid YAML: {e}. Fix the file.") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ProfileError(f"{path}: a profile must be a YAML mapping of keys, not {type(data).__name__}.")
    return data


# --- merging ---------------------------------------------------------------------------------

Origins = dict[tuple, str]   # dotted key path -> where its value came from (file or --set item)


def _merge(base: dict, over: Mapping, origin: str, origins: Origins, prefix: tuple = ()) -> dict:
    """Deep-merge `over` into a copy of `base`; mappings merge, everything else replaces."""
    out = dict(base)
    for key, value in over.items():
        path = (*prefix, key)
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value, origin, origins, path)
        else:
            out[key] = copy.deepcopy(value)
            origins[path] = origin
    return out


def _parse_set(item: str) -> tuple[tuple[str, ...], Any]:
    key, sep, raw = item.partition("=")
    parts = tuple(key.strip().split("."))
    if not sep or not all(parts):
        raise ProfileError(f"--set {item!r}: expected KEY.PATH=VALUE, e.g. --set slurm.account=def-yourpi.")
    try:
        value = yaml.load(raw, Loader=_UniqueKeyLoader) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw                       # not YAML: keep it as the literal string
    return parts, value


def _nest(parts: Sequence[str], value: Any) -> dict:
    for part in reversed(parts):
        value = {part: value}
    return value


def _apply_cluster(raw: dict, cluster: str, origins: Origins) -> dict:
    over = (raw.get("clusters") or {}).get(cluster)
    if not isinstance(over, Mapping):
        return {**raw, "cluster": cluster}
    # Cluster keys map onto profile keys (unknown ones are reported by validation, in place).
    where = {"login_host": ("login_host",), "detect": ("detect",), "gpu_request": ("slurm", "gpu_request"),
             "gpu_types": ("slurm", "gpu_types"), "defaults": ("slurm", "defaults"),
             "catalog": ("catalog",), "network": ("network",), "modules": ("environment", "modules"),
             "env": ("environment", "env")}
    for key, target in where.items():
        if over.get(key) is None or (target[0] == "slurm" and not isinstance(raw.get("slurm"), Mapping)):
            continue
        src = _origin(origins, ("clusters", cluster, key))
        raw = _merge(raw, _nest(target, over[key]), f"{src} (via clusters.{cluster}.{key})", origins)
    return {**raw, "cluster": cluster}


def _origin(origins: Origins, loc: Sequence, default: str = "") -> str:
    """Who set `loc`: the longest recorded prefix, or any recorded key below it."""
    for n in range(len(loc), 0, -1):
        if tuple(loc[:n]) in origins:
            return origins[tuple(loc[:n])]
    below = [src for path, src in origins.items() if path[: len(loc)] == tuple(loc)]
    return below[-1] if below else default


# --- name resolution and detection -----------------------------------------------------------

def _fold(name: str) -> str:
    # "Béluga" -> "beluga": cluster names are typed both ways.
    return unicodedata.normalize("NFKD", name).encode("ascii", "ignore").decode().lower().strip()


def _cluster_owner(name: str) -> str | None:
    for profile, path in _shipped().items():
        if name in (_read_yaml(path).get("clusters") or {}):
            return profile
    return None


def _matches(detect: Mapping, env: Mapping[str, str], hostname: str) -> bool:
    env_rules = detect.get("env") or {}
    hosts = detect.get("hostname_patterns") or []
    env_ok = bool(env_rules) and all(
        k in env and fnmatch.fnmatchcase(_fold(env[k]), str(v)) for k, v in env_rules.items())
    host_ok = any(fnmatch.fnmatchcase(hostname.lower(), str(p)) for p in hosts)
    return env_ok or host_ok


def detect_cluster(env: Mapping[str, str] | None = None,
                   hostname: str | None = None) -> tuple[str, str | None] | None:
    """(profile, cluster) when this looks like a known login node, else None."""
    env = os.environ if env is None else env
    hostname = socket.getfqdn() if hostname is None else hostname
    for profile, path in _shipped().items():
        raw = _read_yaml(path)
        for cluster, over in (raw.get("clusters") or {}).items():   # specific first
            if isinstance(over, Mapping) and _matches(over.get("detect") or {}, env, hostname):
                return profile, cluster
        if _matches(raw.get("detect") or {}, env, hostname):
            return profile, None
    return None


def _resolve(name: str, cluster: str | None, env: Mapping[str, str]) -> tuple[str, Path | None, str | None]:
    """Map a profile or cluster name to (profile name, shipped/user file or None for local, cluster)."""
    if "/" in name or name.endswith((".yaml", ".yml")):
        return Path(name).stem, Path(name).expanduser(), cluster
    folded = _fold(name)
    shipped = _shipped()
    if folded == "local":
        return "local", None, cluster
    if folded in shipped:
        return folded, shipped[folded], cluster
    owner = _cluster_owner(folded)
    if owner:
        return owner, shipped[owner], folded
    user_file = user_config_dir(env) / f"{name}.yaml"
    if user_file.is_file():
        return name, user_file, cluster
    known = list_profiles(env) + [c for p in shipped.values() for c in (_read_yaml(p).get("clusters") or {})]
    hint = difflib.get_close_matches(folded, known, n=1)
    raise ProfileError(f"unknown profile {name!r}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
                       + f"; choose one of: {', '.join(known)}, or give a path to a YAML file.")


# --- validation errors -----------------------------------------------------------------------

def _dotted(loc: Sequence) -> str:
    """slurm.defaults.serve.time; odd keys (newlines, quotes, $(...)) shown by repr, cut at 60 chars."""
    def part(p: Any) -> str:
        if isinstance(p, int):
            return f"[{p}]"
        text = p if isinstance(p, str) and p.replace("_", "").replace("-", "").isalnum() else repr(p)
        return text if len(text) <= 60 else text[:57] + "..."
    return ".".join(part(p) for p in loc)


def _unwrap(tp: Any) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else tp
    return tp


def _valid_keys(loc: Sequence) -> list[str]:
    """Field names of the model found at `loc` in the schema ([] when it is not a model)."""
    tp: Any = Profile
    for part in loc:
        tp = _unwrap(tp)
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            field = tp.model_fields.get(str(part))
            if field is None:
                return []
            tp = field.annotation
        elif typing.get_origin(tp) in (dict, list):
            tp = typing.get_args(tp)[-1]
        else:
            return []
    tp = _unwrap(tp)
    return list(tp.model_fields) if isinstance(tp, type) and issubclass(tp, BaseModel) else []


def _describe(err: Mapping[str, Any], origins: Origins, base: str) -> str:
    loc = [p for p in err["loc"] if p != "[key]"]
    where = _origin(origins, loc, base)
    key = _dotted(loc)
    if err["type"] == "extra_forbidden":
        valid = _valid_keys(loc[:-1])
        hint = difflib.get_close_matches(str(loc[-1]), valid, n=1)
        suggestion = f" (did you mean {_dotted([*loc[:-1], hint[0]])}?)" if hint else ""
        return (f"{where}: unknown key {key}{suggestion}"
                + (f"; valid keys there: {', '.join(valid)}" if valid else ""))
    got = repr(err.get("input"))
    got = got if len(got) <= 60 else got[:57] + "..."
    return f"{where}: {key}: {err['msg']}" + ("" if err["type"] == "missing" else f" (got {got})")


def _validate(raw: dict, origins: Origins, base: str) -> Profile:
    try:
        return Profile.model_validate(raw)
    except ValidationError as e:
        lines = list(dict.fromkeys(_describe(err, origins, base) for err in e.errors()))
        more = f"\n  (+{len(lines) - 5} more)" if len(lines) > 5 else ""
        raise ProfileError("invalid profile:\n  " + "\n  ".join(lines[:5]) + more
                           + "\nFix the key in that file, or the --set item.") from None


# --- loading ---------------------------------------------------------------------------------

def _layers(name: str, source: Path | None, base: dict, overrides: Sequence[str],
            env: Mapping[str, str]) -> list[tuple[str, dict]]:
    """The user file, TGI_HPC_ACCOUNT and --set items, in merge order, each with its label."""
    layers = []
    user_file = user_config_dir(env) / f"{name}.yaml"
    shipped = source is None or source.parent in profile_dirs()
    if shipped and user_file.is_file():   # an explicit or user-only file is not overlaid again
        layers.append((str(user_file), _read_yaml(user_file)))
    if env.get("TGI_HPC_ACCOUNT") and isinstance(base.get("slurm"), Mapping):
        layers.append(("TGI_HPC_ACCOUNT", {"slurm": {"account": env["TGI_HPC_ACCOUNT"]}}))
    for item in overrides:
        parts, value = _parse_set(item)
        layers.append((f"--set {item}", _nest(parts, value)))
    return layers


def _pick_cluster(raw: dict, cluster: str | None, label: str) -> str | None:
    clusters = raw.get("clusters") or {}
    if cluster is None:
        return None
    cluster = _fold(cluster)
    if cluster not in clusters:
        raise ProfileError(f"{label}: no cluster {cluster!r} in profile {raw.get('name')!r}; "
                           f"known clusters: {', '.join(clusters) or 'none'}.")
    over = clusters[cluster] if isinstance(clusters[cluster], Mapping) else {}
    if over.get("retired"):
        new = over.get("replaced_by")
        instead = f"; use {new!r} instead (e.g. -p {new})" if new else ""
        raise ProfileError(f"cluster {cluster!r} is retired{instead}.")
    return cluster


def load_profile(name: str | None = None, *, cluster: str | None = None, overrides: Sequence[str] = (),
                 path: Path | None = None, env: Mapping[str, str] | None = None) -> Profile:
    """Load, merge (see the module docstring) and validate a profile.

    `name` is a profile (local, mila, computecanada), a DRAC cluster (narval, fir, ...) or a
    YAML path; None means $TGI_HPC_CLUSTER, then the detected login node, then `local`.
    """
    env = os.environ if env is None else env
    if path is not None:
        profile_name, source, named_cluster = Path(path).stem, Path(path).expanduser(), cluster
    else:
        if name is None and not env.get("TGI_HPC_CLUSTER"):
            detected = detect_cluster(env)
            name = (detected[1] or detected[0]) if detected else "local"
        profile_name, source, named_cluster = _resolve(name or env["TGI_HPC_CLUSTER"], cluster, env)
    base = _local_profile(env) if source is None else _read_yaml(source)
    label = str(source) if source else "built-in profile 'local'"
    if named_cluster is None and path is None and base.get("clusters"):
        detected = detect_cluster(env)    # on a login node, `-p computecanada` means this cluster
        named_cluster = detected[1] if detected and detected[0] == profile_name else None
    origins: Origins = {}
    layers = _layers(profile_name, source, base, overrides, env)
    raw = base
    for layer_label, layer in layers:  # clusters first: the chosen cluster may be edited too
        if "clusters" in layer:
            raw = _merge(raw, {"clusters": layer["clusters"]}, layer_label, origins)
    chosen = _pick_cluster(raw, named_cluster, label)
    if chosen is not None:
        raw = _apply_cluster(raw, chosen, origins)
    for layer_label, layer in layers:
        raw = _merge(raw, {k: v for k, v in layer.items() if k != "clusters"}, layer_label, origins)
    return _validate(raw, origins, label)


def require_account(profile: Profile) -> str | None:
    """The Slurm account to submit with; raises when the cluster needs one and none is set."""
    slurm = profile.slurm
    if slurm is None or slurm.account or not slurm.account_required:
        return slurm.account if slurm else None
    where = user_config_dir() / f"{profile.name}.yaml"
    raise ProfileError(
        f"profile {_label(profile)} needs a Slurm account "
        "(--account), e.g. def-yourpi. Set it with one of:\n"
        "  --set slurm.account=def-yourpi\n"
        "  export TGI_HPC_ACCOUNT=def-yourpi\n"
        f"  slurm: {{account: def-yourpi}}   in {where}")


def resources_for(profile: Profile, kind: JobKind, num_params_b: float | None = None,
                  gpus: int | None = None) -> Resources:
    """slurm.defaults[kind], then (serve) the smallest catalog entry that fits, then explicit choices."""
    base = (profile.slurm.defaults.get(kind) if profile.slurm else None) or Resources()
    if kind == "serve" and num_params_b is not None and profile.catalog:
        entries = sorted(profile.catalog, key=lambda e: e.max_params_b)
        fits = [e for e in entries if e.max_params_b >= num_params_b]
        if not fits and gpus is None:
            raise ProfileError(
                f"profile {_label(profile)}: no catalog entry for a {num_params_b:g}B model (largest: "
                f"{entries[-1].label}); pass the resources explicitly (e.g. --gpus) or add a catalog entry.")
        base = _over(base, (fits or entries[-1:])[0].resources)
    return _over(base, Resources(gpus=gpus)) if gpus is not None else base


def _label(profile: Profile) -> str:
    return repr(profile.name) + (f" (cluster {profile.cluster})" if profile.cluster else "")


def _over(base: Resources, top: Resources) -> Resources:
    update = top.model_dump(exclude_none=True, exclude={"extra"})
    return base.model_copy(update={**update, "extra": {**base.extra, **top.extra}})
