"""The cluster's job rules (wall time, whole nodes, partitions, account prefix), checked before submitting.

Every refusal names the rule and cites the page that states it, so a job is never refused by Slurm
(or killed, or left pending forever) after its queue wait for something we could have said now.
"""
from __future__ import annotations

import fnmatch
import math
import re

from tgi_hpc.errors import UsageError
from tgi_hpc.profiles.schema import Profile, Resources, TimeRule

_TIME = re.compile(r"^(?:(?P<d>\d+)-)?(?P<a>\d+)(?::(?P<b>\d+))?(?::(?P<c>\d+))?$")


def parse_time(value: str) -> int:
    """A Slurm time string in seconds: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S (sbatch(1), --time)."""
    m = _TIME.match(value.strip())
    if not m:
        raise UsageError(f"--time {value!r}: not a Slurm time (e.g. 30:00, 3:00:00 or 1-12:00:00)")
    d, a, b, c = (int(x) if x is not None else None for x in m.group("d", "a", "b", "c"))
    if d is None:
        if b is None:
            return a * 60                                  # minutes
        return a * 60 + b if c is None else a * 3600 + b * 60 + c   # M:S or H:M:S
    return d * 86400 + a * 3600 + (b or 0) * 60 + (c or 0)  # D-H[:M[:S]]


def _human(seconds: int) -> str:
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes = rest // 60
    parts = [f"{days} d" if days else "", f"{hours} h" if hours else "", f"{minutes} min" if minutes else ""]
    return " ".join(p for p in parts if p) or f"{seconds} s"


def _where(profile: Profile) -> str:
    return profile.cluster or profile.name


def _check_time(profile: Profile, res: Resources, rule: TimeRule | None, what: str) -> None:
    if rule is None or not res.time:
        return
    seconds = parse_time(res.time)
    if rule.min and seconds < parse_time(rule.min):
        raise UsageError(f"{_where(profile)}: {what} must run at least {_human(parse_time(rule.min))}; "
                         f"--time {res.time} is {_human(seconds)} (source: {rule.min_source or rule.source})")
    if rule.max and seconds > parse_time(rule.max):
        raise UsageError(f"{_where(profile)}: {what} may run at most {_human(parse_time(rule.max))}; "
                         f"--time {res.time} is {_human(seconds)} (source: {rule.source})")


def _check_partition(profile: Profile, res: Resources) -> None:
    rule = profile.rules.partitions.get(res.partition or "")
    if rule is None:
        return
    part = f"{_where(profile)} partition {res.partition}"
    if rule.max_time and res.time and parse_time(res.time) > parse_time(rule.max_time):
        raise UsageError(f"{part} allows at most {_human(parse_time(rule.max_time))} per job; --time {res.time} "
                         f"is longer: pick another partition (-p) or a shorter --time (source: {rule.source})")
    if rule.max_gpus is not None and (res.gpus or 0) > rule.max_gpus:
        raise UsageError(f"{part} allows at most {rule.max_gpus} GPUs per job, not {res.gpus} (source: {rule.source})")
    if rule.max_cpus_per_task is not None and (res.cpus_per_task or 0) > rule.max_cpus_per_task:
        raise UsageError(f"{part} allows at most {rule.max_cpus_per_task} CPUs per job, not {res.cpus_per_task} "
                         f"(source: {rule.source})")
    if rule.gpu_types is not None and res.gpus and res.gpu_type and res.gpu_type not in rule.gpu_types:
        raise UsageError(f"{part} has no {res.gpu_type} GPUs (it has {', '.join(rule.gpu_types) or 'none'}) "
                         f"(source: {rule.source})")


def _check_whole_nodes(profile: Profile, res: Resources) -> None:
    rule = profile.rules.whole_nodes
    if rule is None or not res.gpus:
        return
    sizes = ", ".join(f"{n}x {t}" for t, n in rule.gpus_per_node.items())
    node_type = res.gpu_type or rule.untyped
    if node_type not in rule.gpus_per_node:
        raise UsageError(f"{_where(profile)} gives GPU jobs whole nodes ({sizes}): name the GPU type "
                         f"(--gpu-type TYPE) (source: {rule.source})")
    per_node, nodes = rule.gpus_per_node[node_type], res.nodes or 1
    if nodes == 1 and res.gpus in rule.partial:
        return
    if res.gpus != per_node * nodes:
        single = f"{' or '.join(map(str, rule.partial))} GPU(s) on one node, or " if rule.partial else ""
        raise UsageError(f"{_where(profile)} gives GPU jobs whole nodes: a {node_type} job asks for {single}exactly "
                         f"{per_node} GPUs per node, not {res.gpus} on {nodes} node(s) (--gpus {per_node * nodes}) "
                         f"(source: {rule.source})")


def allowed_count(profile: Profile, gpu_type: str | None, count: int) -> int:
    """The smallest GPU count at least `count` that the cluster's rules let one job ask for."""
    rule = profile.rules.whole_nodes
    per_node = rule.gpus_per_node.get(gpu_type or rule.untyped or "") if rule else None
    if rule and per_node:
        partial = [n for n in sorted(rule.partial) if n >= count]
        return partial[0] if partial else math.ceil(count / per_node) * per_node
    allowed = sorted(profile.slurm.allowed_gpu_counts) if profile.slurm else []
    return next((n for n in allowed if n >= count), count)


def _check_gpu_type_named(profile: Profile, res: Resources) -> None:
    rule = profile.rules.gpu_type
    if rule and res.gpus and not res.gpu_type:
        known = profile.slurm.gpu_types if profile.slurm else []
        raise UsageError(f"{_where(profile)}: a GPU job must name its GPU type ({', '.join(known)}: --gpu-type TYPE); "
                         f"without one it may be rejected or sent to an arbitrary GPU (source: {rule.source})")


def _check_mig(profile: Profile, res: Resources) -> None:
    rule = profile.rules.mig
    if rule and res.gpu_type and fnmatch.fnmatchcase(res.gpu_type, rule.pattern) and (res.gpus or 0) > rule.max_instances:
        raise UsageError(f"{_where(profile)}: {res.gpu_type} is a MIG instance, and a job may ask for at most "
                         f"{rule.max_instances}, not {res.gpus}: pick a whole GPU (--gpu-type) or fewer --gpus "
                         f"(source: {rule.source})")


def _check_account(profile: Profile) -> None:
    rule, account = profile.rules.account, profile.slurm.account if profile.slurm else None
    if rule and account and not account.startswith(rule.prefix):
        raise UsageError(f"{_where(profile)} jobs run under a {rule.prefix}... account, not {account!r} "
                         f"(--set slurm.account={rule.prefix}yourpi) (source: {rule.source})")


def _check_gpu_type(profile: Profile, res: Resources) -> None:
    if res.gpus and res.gpu_type:
        check_gpu_type(profile, res.gpu_type)


def check_gpu_type(profile: Profile, gpu_type: str) -> None:
    """UsageError unless `gpu_type` is one of the profile's slurm.gpu_types (when it lists any)."""
    known = profile.slurm.gpu_types if profile.slurm else []
    if known and gpu_type not in known:
        raise UsageError(f"{_where(profile)} has no GPU type {gpu_type!r}; it has: {', '.join(known)} "
                         "(profile: slurm.gpu_types)")


def fit_partition(profile: Profile, res: Resources, fallback: str | None) -> Resources:
    """`res` on `fallback` (the profile's default partition) when its own partition cannot take its GPUs
    (e.g. --gpus 2 for a size the catalog puts on a 1-GPU partition)."""
    rule = profile.rules.partitions.get(res.partition or "")
    if rule is None or rule.max_gpus is None or (res.gpus or 0) <= rule.max_gpus or not fallback:
        return res
    return res.model_copy(update={"partition": fallback})


def check_job(profile: Profile, res: Resources) -> None:
    """Raise UsageError, citing the rule's page, when `res` breaks a rule of this cluster."""
    if profile.slurm is None:
        return
    allowed, per_node = profile.slurm.allowed_gpu_counts, (res.gpus or 0) // (res.nodes or 1)
    if allowed and res.gpus and per_node not in allowed:
        raise UsageError(f"{_where(profile)} jobs may ask for {' or '.join(map(str, allowed))} GPUs"
                         f"{' per node' if (res.nodes or 1) > 1 else ''}, not {per_node} "
                         "(profile: slurm.allowed_gpu_counts)")
    rules = profile.rules
    cpu_job = not res.gpus
    time_rule = rules.cpu_time if cpu_job and rules.cpu_time else rules.time
    _check_time(profile, res, time_rule, f"{'CPU' if cpu_job else 'GPU'} jobs" if rules.cpu_time else "jobs")
    _check_partition(profile, res)
    _check_whole_nodes(profile, res)
    _check_gpu_type_named(profile, res)
    _check_gpu_type(profile, res)
    _check_mig(profile, res)
    _check_account(profile)
