"""The job lifecycle: submit a rendered script, watch it, probe it, show its log, stop it.

States: PENDING (with Slurm's reason) -> STARTING -> READY -> COMPLETED / FAILED / CANCELLED /
TIMEOUT. They come from Slurm's state plus a real readiness probe, never from log text.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

from tgi_hpc.errors import JobFailedError, ReadinessTimeout, SlurmError
from tgi_hpc.profiles.rules import check_job
from tgi_hpc.remote.runner import LocalRunner
from tgi_hpc.slurm.backend import log_path, script_path
from tgi_hpc.slurm.cluster import Cluster
from tgi_hpc.slurm.commands import SlurmJob
from tgi_hpc.slurm.endpoint import Endpoint, endpoint_file
from tgi_hpc.slurm.jobspec import JOB_NAME_PREFIX, JobSpec
from tgi_hpc.slurm.render import render_job

logger = logging.getLogger(__name__)

_RUNNING = {"RUNNING", "COMPLETING", "CONFIGURING", "STAGE_OUT"}
_QUEUED = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "SUSPENDED", "RESIZING"}
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED",
         "BOOT_FAIL", "DEADLINE", "REVOKED", "UNKNOWN"}


@dataclass
class Submission:
    script: str
    job_id: str | None = None
    script_path: str | None = None
    log_path: str | None = None


@dataclass
class JobStatus:
    job_id: str
    kind: str
    state: str                    # PENDING, STARTING, READY, RUNNING (non-serve), or a final state
    slurm_state: str
    reason: str = ""
    node: str = ""
    url: str = ""
    port: int | None = None
    api_key_file: str = ""
    log: str = ""
    detail: str = ""
    endpoint: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        """One progress line: `job 4148: PENDING (Resources)` / `job 4148: READY on cn-g017`."""
        return (f"job {self.job_id}: {self.state}" + (f" ({self.reason})" if self.reason else "")
                + (f" on {self.node}" if self.node else ""))


def render(cluster: Cluster, spec: JobSpec, **kwargs) -> str:
    """The job script, once the cluster's rules accept the job's resources (dry runs included)."""
    if not isinstance(cluster.runner, LocalRunner):
        kwargs.setdefault("python", cluster.profile.remote_python)
    script = render_job(cluster.profile, spec, job_dir=cluster.job_dir, **kwargs)  # refuses unsafe values first
    check_job(cluster.profile, spec.resources)
    return script


def submit(cluster: Cluster, spec: JobSpec, *, env: dict[str, str] | None = None, **kwargs) -> Submission:
    """Render and submit. `env` reaches the job through sbatch's environment, never the script."""
    script = render(cluster, spec, **kwargs)
    job_id = cluster.backend.submit(script, spec.name, env=env)
    return Submission(script, job_id, script_path(cluster.job_dir, job_id), log_path(cluster.job_dir, job_id))


def read_endpoint(cluster: Cluster, job_id: str) -> Endpoint | None:
    try:
        return Endpoint.from_json(cluster.runner.read_file(endpoint_file(cluster.job_dir, job_id)))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read_api_key(cluster: Cluster, endpoint: Endpoint) -> str | None:
    if not endpoint.api_key_file:
        return None
    try:
        return cluster.runner.read_file(endpoint.api_key_file).strip() or None
    except OSError:
        return None


def _status(cluster: Cluster, job_id: str, job: SlurmJob | None, with_probe: bool) -> JobStatus:
    if job is None:
        return JobStatus(job_id, "", "UNKNOWN", "UNKNOWN", detail="Slurm does not know this job")
    kind = job.name[len(JOB_NAME_PREFIX):] if job.name.startswith(JOB_NAME_PREFIX) else job.name
    status = JobStatus(job_id, kind, job.state, job.state, job.reason, job.node, log=log_path(cluster.job_dir, job_id))
    if job.state in _QUEUED:
        status.state = "PENDING"
    elif job.state in _RUNNING and kind == "serve":
        status.state = "STARTING"
        endpoint = read_endpoint(cluster, job_id)
        # A requeued job may still show the endpoint of its previous run: trust only this run's node.
        if endpoint is not None and (not job.node or endpoint.node == job.node or endpoint.host == job.node):
            status.url, status.port, status.api_key_file = endpoint.url, endpoint.port, endpoint.api_key_file
            status.endpoint = {"host": endpoint.host, "node": endpoint.node, "port": endpoint.port}
            if with_probe:
                from tgi_hpc.slurm.readiness import probe_from  # httpx: only when a server is there to probe

                result = probe_from(cluster.runner, endpoint.url, read_api_key(cluster, endpoint))
                status.detail = result.detail
                if result.ready:
                    status.state = "READY"
    elif job.state in _RUNNING:
        status.state = "RUNNING"
    return status


def status(cluster: Cluster, job_ids: list[str] | None = None, *, with_probe: bool = True) -> list[JobStatus]:
    """Given ids: those jobs (even finished ones). No ids: all my tgi-hpc jobs still queued or running."""
    if job_ids:
        known = cluster.backend.states(job_ids)
        return [_status(cluster, j, known.get(j), with_probe) for j in job_ids]
    return [_status(cluster, job.job_id, job, with_probe) for job in cluster.backend.mine()]


def wait(cluster: Cluster, job_id: str, *, until: set[str], timeout: float,
         on_change: Callable[[JobStatus], None] | None = None) -> JobStatus:
    """Poll with a short-then-longer backoff (as submitit's watcher does) until a wanted state."""
    deadline, delay, last = time.monotonic() + timeout, 0.25, None
    while True:
        try:
            current = status(cluster, [job_id])[0]
        except SlurmError as exc:  # a busy controller times out now and then: keep watching
            if time.monotonic() > deadline:
                raise
            logger.warning("could not read job %s's state (%s); retrying", job_id, exc)
            time.sleep(delay)
            delay = min(delay * 1.5, 5.0)
            continue
        if on_change and (last is None or (current.state, current.reason) != (last.state, last.reason)):
            on_change(current)
        last = current
        if current.state in until:
            return current
        if current.state in FINAL:
            raise JobFailedError(f"job {job_id} ended {current.state} before {'/'.join(sorted(until))}; "
                                 f"see its log: {current.log}")
        if time.monotonic() > deadline:
            raise ReadinessTimeout(f"job {job_id} is still {current.state}"
                                   f"{' (' + current.reason + ')' if current.reason else ''} after {timeout:.0f} s; "
                                   f"`tgi-hpc status {job_id}` keeps watching, the job keeps running")
        time.sleep(delay)
        delay = min(delay * 1.5, 5.0)


def stop(cluster: Cluster, job_ids: list[str] | None = None) -> list[str]:
    """Cancel these jobs, or (None) all my tgi-hpc jobs; unknown ids are an error, after the rest."""
    if job_ids is None:
        ids, unknown = [j.job_id for j in cluster.backend.mine()], []
    else:
        known = cluster.backend.states(job_ids)
        ids, unknown = [j for j in job_ids if j in known], [j for j in job_ids if j not in known]
    if ids:
        cluster.backend.cancel(ids)
    if unknown:
        done = f" (stopped {' '.join(ids)})" if ids else ""
        raise SlurmError(f"no such job: {' '.join(unknown)}{done}")
    return ids


def logs(cluster: Cluster, job_id: str) -> str:
    try:
        return cluster.runner.read_file(log_path(cluster.job_dir, job_id))
    except OSError as exc:
        raise SlurmError(f"no log for job {job_id} at {log_path(cluster.job_dir, job_id)} (not started yet?)") from exc


def follow(cluster: Cluster, job_id: str, poll: float = 1.0) -> Iterator[str]:
    """New log text as it arrives, until the job is over."""
    offset = 0
    while True:
        try:
            text = cluster.runner.read_file(log_path(cluster.job_dir, job_id))
        except OSError:
            text = ""
        if len(text) > offset:
            yield text[offset:]
            offset = len(text)
        if status(cluster, [job_id], with_probe=False)[0].state in FINAL:
            return
        time.sleep(poll)
