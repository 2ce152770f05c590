"""Load cluster profiles: find, read, merge and validate them against the schema in tgi_hpc.profiles.schema.

Merge order (later wins), then one validation against the schema:

1. the base: the built-in ``local`` dict, a shipped ``profiles/<name>.yaml``, or an explicit file;
2. ``clusters[<cluster>]`` of that profile applied over it (cluster from the name, e.g. ``narval``,
   the ``cluster=`` argument, or login-node detection; none applied = the profile's generic values);
   ``clusters`` entries from steps 3-5 are merged in first, so a user may edit a cluster too;
3. the user file ``<user_config_dir>/<name>.yaml``, deep-merged (mappings merge, lists replace);
4. ``TGI_HPC_ACCOUNT`` fills ``slurm.account``;
5. ``--set key.path=value`` overrides, values parsed as YAML (``--set slurm.defaults.serve.gpus=2``).

Any error names the file (or ``--set`` item) and the dotted key that caused it. The parts: strict YAML in
tgi_hpc.profiles.yaml_file, merging in tgi_hpc.profiles.merge, validation errors in tgi_hpc.profiles.validation.
"""
from __future__ import annotations

import difflib
import fnmatch
import os
import socket
import unicodedata
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tgi_hpc.data import data_dir
from tgi_hpc.errors import ProfileError
from tgi_hpc.profiles.merge import Origins, apply_cluster, merge, nest, parse_set
from tgi_hpc.profiles.schema import JobKind, Profile, Resources
from tgi_hpc.profiles.validation import validate_profile
from tgi_hpc.profiles.yaml_file import read_yaml


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


# --- name resolution and detection -----------------------------------------------------------

def _fold(name: str) -> str:
    # "Béluga" -> "beluga": cluster names are typed both ways.
    return unicodedata.normalize("NFKD", name).encode("ascii", "ignore").decode().lower().strip()


def _cluster_owner(name: str) -> str | None:
    for profile, path in _shipped().items():
        if name in (read_yaml(path).get("clusters") or {}):
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
        raw = read_yaml(path)
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
    known = list_profiles(env) + [c for p in shipped.values() for c in (read_yaml(p).get("clusters") or {})]
    hint = difflib.get_close_matches(folded, known, n=1)
    raise ProfileError(f"unknown profile {name!r}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
                       + f"; choose one of: {', '.join(known)}, or give a path to a YAML file.")


# --- loading ---------------------------------------------------------------------------------

def _layers(name: str, source: Path | None, base: dict, overrides: Sequence[str],
            env: Mapping[str, str]) -> list[tuple[str, dict]]:
    """The user file, TGI_HPC_ACCOUNT and --set items, in merge order, each with its label."""
    layers = []
    user_file = user_config_dir(env) / f"{name}.yaml"
    shipped = source is None or source.parent in profile_dirs()
    if shipped and user_file.is_file():   # an explicit or user-only file is not overlaid again
        layers.append((str(user_file), read_yaml(user_file)))
    if env.get("TGI_HPC_ACCOUNT") and isinstance(base.get("slurm"), Mapping):
        layers.append(("TGI_HPC_ACCOUNT", {"slurm": {"account": env["TGI_HPC_ACCOUNT"]}}))
    for item in overrides:
        parts, value = parse_set(item)
        layers.append((f"--set {item}", nest(parts, value)))
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
        instead = f"; use {new!r} instead (--cluster {new})" if new else ""
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
    base = _local_profile(env) if source is None else read_yaml(source)
    label = str(source) if source else "built-in profile 'local'"
    if named_cluster is None and path is None and base.get("clusters"):
        detected = detect_cluster(env)    # on a login node, `-p computecanada` means this cluster
        named_cluster = detected[1] if detected and detected[0] == profile_name else None
    origins: Origins = {}
    layers = _layers(profile_name, source, base, overrides, env)
    raw = base
    for layer_label, layer in layers:  # clusters first: the chosen cluster may be edited too
        if "clusters" in layer:
            raw = merge(raw, {"clusters": layer["clusters"]}, layer_label, origins)
    chosen = _pick_cluster(raw, named_cluster, label)
    if chosen is not None:
        raw = apply_cluster(raw, chosen, origins)
    for layer_label, layer in layers:
        raw = merge(raw, {k: v for k, v in layer.items() if k != "clusters"}, layer_label, origins)
    return validate_profile(raw, origins, label)


def require_account(profile: Profile) -> str | None:
    """The Slurm account to submit with; raises when the cluster needs one and none is set."""
    slurm = profile.slurm
    if slurm is None or slurm.account or not slurm.account_required:
        return slurm.account if slurm else None
    where = user_config_dir() / f"{profile.name}.yaml"
    example = (profile.rules.account.prefix if profile.rules.account else "def-") + "yourpi"
    raise ProfileError(
        f"profile {_label(profile)} needs a Slurm account "
        f"(sbatch --account), e.g. {example}. Set it with one of:\n"
        f"  --set slurm.account={example}\n"
        f"  export TGI_HPC_ACCOUNT={example}\n"
        f"  slurm: {{account: {example}}}   in {where}")


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
    update = top.model_dump(exclude_unset=True, exclude={"extra"})  # an explicit null clears a default
    return base.model_copy(update={**update, "extra": {**base.extra, **top.extra}})
