"""`tgi-hpc logs BATCH`: the logs of a batch's jobs, each task of a job array on its own, in task order.

BATCH is a job id (a plain job: its log; a job array: every task's log, ARRAY_TASK.out) or a batch (its
output file, or the OUTPUT.tgi-batch folder): the logs of every job it submitted, oldest first.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from tgi_hpc.batch.submission import JOBS, batch_dir_of
from tgi_hpc.errors import SlurmError, UsageError
from tgi_hpc.slurm.backend import log_path
from tgi_hpc.slurm.cluster import Cluster
from tgi_hpc.workflows.serve import cluster_path

_JOB_ID = re.compile(r"\d+(_\d+)?")


def job_ids_of(cluster: Cluster, target: str) -> list[str]:
    """The jobs behind TARGET: itself when it is a job id, else those the batch at TARGET submitted."""
    if _JOB_ID.fullmatch(target):
        return [target]
    if not cluster.is_local:
        raise UsageError(f"{target!r} is not a job id; a batch's folder is read on the cluster's login node")
    path = Path(cluster_path(cluster, target))
    for batch_dir in (path, batch_dir_of(path)):
        if (batch_dir / "manifest.json").is_file():
            try:
                return [str(j) for j in json.loads((batch_dir / JOBS).read_text())]
            except (OSError, ValueError):
                raise SlurmError(f"batch {batch_dir} has submitted no job yet") from None
    raise UsageError(f"{target!r} is neither a job id (4148, 4148_2) nor a batch (its --output or its folder)")


def _task_number(name: str) -> int:
    return int(name.rsplit("_", 1)[1][: -len(".out")])


def log_names(cluster: Cluster, job_id: str) -> list[str]:
    """The log ids of a job: its tasks' (4148_0, 4148_1 ...) when it is a job array, else itself."""
    if "_" in job_id:
        return [job_id]
    found = cluster.runner.run(["find", cluster.job_dir, "-maxdepth", "1", "-name", f"{job_id}_*.out"])
    names = sorted((Path(line).name for line in found.stdout.splitlines()
                    if re.fullmatch(rf"{job_id}_\d+\.out", Path(line).name)), key=_task_number)
    return [name[: -len(".out")] for name in names] or [job_id]


def logs(cluster: Cluster, target: str) -> dict[str, str]:
    """{job or task id: its log}, in submission and task order; ids without a log yet are left out, and
    SlurmError when none has one."""
    found: dict[str, str] = {}
    for job_id in job_ids_of(cluster, target):
        for name in log_names(cluster, job_id):
            try:
                found[name] = cluster.runner.read_file(log_path(cluster.job_dir, name))
            except OSError:
                continue
    if not found:
        raise SlurmError(f"no log for {target} in {cluster.job_dir} (not started yet?)")
    return found


def followed(cluster: Cluster, target: str) -> str:
    """The one job or task that `logs --follow TARGET` follows (a job array or a batch has a log per task)."""
    names = [name for job_id in job_ids_of(cluster, target) for name in log_names(cluster, job_id)]
    if len(names) != 1:
        raise UsageError(f"{target} has {len(names)} logs ({', '.join(names[:4])}{'...' if len(names) > 4 else ''}): "
                         f"follow one task, e.g. `tgi-hpc logs {names[0]} -f`")
    return names[0]
