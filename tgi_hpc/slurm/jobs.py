"""The job lifecycle: submit a rendered script, watch it, probe it, show its log, stop it.

States: PENDING (with Slurm's reason) -> STARTING -> READY -> ENDING -> COMPLETED / FAILED /
CANCELLED / TIMEOUT. They come from Slurm's state plus a real readiness probe, never from log text;
LISTENING is a server whose endpoint is published but that was not probed (`status --no-probe`).
"""
from __future__ import annotations

import logging
import os
import re
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

_RUNNING = {"RUNNING", "CONFIGURING"}
_ENDING = {"COMPLETING", "STAGE_OUT", "SIGNALING", "STOPPED"}
ACTIVE = {"PENDING", "STARTING", "LISTENING", "READY", "RUNNING", "ENDING"}
_QUEUED = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "SUSPENDED", "RESIZING"}
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED",
         "BOOT_FAIL", "DEADLINE", "REVOKED", "UNKNOWN"}
MAX_POLL_ENV = "TGI_HPC_MAX_POLL_S"


def max_poll_s(default: float = 5.0) -> float:
    """The longest pause between two polls of `wait`: 5 s, or TGI_HPC_MAX_POLL_S (0.1-60 s; the test suite
    sets 1 s so that a READY job is noticed sooner). A value that is not such a number is ignored."""
    try:
        value = float(os.environ.get(MAX_POLL_ENV, ""))
    except ValueError:
        return default
    return value if 0.1 <= value <= 60 else default


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
    model: str = ""
    elapsed: str = ""             # Slurm's run time so far (squeue %M / sacct Elapsed)
    endpoint: dict = field(default_factory=dict)
    served: list[str] = field(default_factory=list)   # names requests may use: models and LoRA adapters
    models: list[dict] = field(default_factory=list)  # each engine: model, url, port, adapters
    batch: dict = field(default_factory=dict)         # a batch job's progress (Progress.to_dict), else empty

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        """One progress line: `job 4148: PENDING (Resources)` / `job 4148: READY on cn-g017`."""
        return (f"job {self.job_id}: {self.state}" + (f" ({self.reason})" if self.reason else "")
                + (f" on {self.node}" if self.node else ""))


def heartbeat(progress: Callable[[str], None]) -> Callable[[JobStatus, float, str], None]:
    """A `wait` beat as one progress line: state, time waited, the log's last line."""
    def beat(st: JobStatus, waited: float, last_line: str) -> None:
        minutes, seconds = divmod(int(waited), 60)
        progress(f"job {st.job_id}: still {st.state}" + (f" ({st.reason})" if st.reason else "")
                 + f" after {minutes}m{seconds:02d}s" + (f"; log: {last_line}" if last_line else ""))
    return beat


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
    status = JobStatus(job_id, kind, job.state, job.state, job.reason, job.node, log=log_path(cluster.job_dir, job_id),
                       elapsed=job.elapsed)
    if job.state in _QUEUED:
        status.state = "PENDING"
    elif job.state in _ENDING:
        status.state, status.reason = "ENDING", ""
    elif job.state in FINAL:
        status.reason = ""      # a pending reason from before the end is no longer true
    elif job.state in _RUNNING and kind == "serve":
        status.state = "STARTING"
        endpoint = read_endpoint(cluster, job_id)
        # A requeued job may still show the endpoint of its previous run: trust only this run's node.
        if endpoint is not None and (not job.node or endpoint.node == job.node or endpoint.host == job.node):
            status.url, status.port, status.api_key_file = endpoint.url, endpoint.port, endpoint.api_key_file
            status.endpoint = {"host": endpoint.host, "node": endpoint.node, "port": endpoint.port}
            status.model = endpoint.model
            status.served = endpoint.served_names
            status.models = [{"model": e.model, "url": endpoint.url_of(e), "port": e.port, "adapters": list(e.adapters)}
                             for e in endpoint.engines]
            if not with_probe:
                status.state, status.detail = "LISTENING", "endpoint published; not probed"
            else:
                from tgi_hpc.slurm.readiness import probe_engines  # httpx: only when a server is there to probe

                result = probe_engines(cluster.runner, endpoint, read_api_key(cluster, endpoint),
                                       generate=with_probe == "generate")
                status.detail = result.detail
                if result.ready:
                    status.state = "READY"
    elif job.state in _RUNNING:
        status.state = "RUNNING"
    return status


def status(cluster: Cluster, job_ids: list[str] | None = None, *,
           with_probe: bool | str = True) -> list[JobStatus]:
    """Given ids: those jobs (even finished ones). No ids: my tgi-hpc jobs Slurm still lists, active
    ones first, newest first. `with_probe`: True = /health, "generate" = also a one-token /generate
    (what `wait` uses for READY), False = no probe."""
    if job_ids:
        known = cluster.backend.states(job_ids)
        rows = [_status(cluster, t, known.get(t), with_probe) for j in job_ids for t in _tasks_of(j, known)]
    else:
        rows = [_status(cluster, job.job_id, job, with_probe) for job in cluster.backend.mine()]
        rows.sort(key=lambda st: (st.state not in ACTIVE, -_id_number(st.job_id)))
    _fill_models(cluster, [st for st in rows if st.kind in ("serve", "batch") and not st.model])
    return rows


def _tasks_of(job_id: str, known: dict[str, SlurmJob]) -> list[str]:
    """A job array's id stands for its tasks (Slurm lists 4148_0, 4148_1, 4148_[2-3] when pending, never 4148
    itself), in task order; any other id for itself."""
    if job_id in known or "_" in job_id:
        return [job_id]
    tasks = [k for k in known if k.split("_", 1)[0] == job_id and "_" in k]
    return sorted(tasks, key=_task_number) or [job_id]


def _task_number(task_id: str) -> int:
    digits = re.match(r"\[?(\d+)", task_id.split("_", 1)[1])
    return int(digits.group(1)) if digits else 0


def _id_number(job_id: str) -> int:
    head = job_id.split("_")[0]
    return int(head) if head.isdigit() else 0


def _fill_models(cluster: Cluster, rows: list[JobStatus]) -> None:
    """The model of jobs without a published endpoint, from their saved scripts (one command for all)."""
    if not rows:
        return
    paths = [script_path(cluster.job_dir, st.job_id) for st in rows]
    result = cluster.runner.run(["grep", "-H", "-m1", "^# Model: ", *paths])
    by_path = {}
    for line in result.stdout.splitlines():
        path, _, rest = line.partition(":# Model: ")
        by_path[path] = rest.strip()
    for st, path in zip(rows, paths):
        st.model = by_path.get(path, "")


def wait(cluster: Cluster, job_id: str, *, until: set[str], timeout: float,
         on_change: Callable[[JobStatus], None] | None = None,
         on_beat: Callable[[JobStatus, float, str], None] | None = None, beat_every: float = 30.0,
         again: str = "") -> JobStatus:
    """Poll with a short-then-longer backoff (as submitit's watcher does) until a wanted state.

    on_change gets each new state; on_beat(status, seconds waited, last log line) comes every
    `beat_every` seconds in between, so a long model load never looks frozen. `again`: the options
    that reach this cluster, appended to the commands the timeout message suggests.
    """
    start = time.monotonic()
    deadline, delay, last, next_beat = start + timeout, 0.25, None, start + beat_every
    longest = max_poll_s()
    probe = "generate" if "READY" in until else True
    while True:
        try:
            current = status(cluster, [job_id], with_probe=probe)[0]
        except SlurmError as exc:  # a busy controller times out now and then: keep watching
            if time.monotonic() > deadline:
                raise
            logger.warning("could not read job %s's state (%s); retrying", job_id, exc)
            time.sleep(delay)
            delay = min(delay * 1.5, longest)
            continue
        if last is None or (current.state, current.reason) != (last.state, last.reason):
            if on_change:
                on_change(current)
            next_beat = time.monotonic() + beat_every
        elif on_beat and time.monotonic() >= next_beat:
            on_beat(current, time.monotonic() - start, last_log_line(cluster, job_id))
            next_beat = time.monotonic() + beat_every
        last = current
        if current.state in until:
            return current
        if current.state in FINAL:
            cause = failure_cause(cluster, job_id)
            raise JobFailedError(f"job {job_id} ended {current.state} before {'/'.join(sorted(until))}"
                                 + (f"; the end of its log ({current.log}):\n{cause}" if cause
                                    else f"; its log is empty or missing: {current.log}"))
        if time.monotonic() > deadline:
            raise ReadinessTimeout(f"job {job_id} is still {current.state}"
                                   f"{' (' + current.reason + ')' if current.reason else ''} after {timeout:.0f} s; "
                                   f"the job keeps running: check it with `tgi-hpc status {job_id}{again}`, "
                                   f"read its log with `tgi-hpc logs {job_id} -f{again}`, "
                                   f"stop it with `tgi-hpc stop {job_id}{again}`")
        time.sleep(delay)
        delay = min(delay * 1.5, longest)


@dataclass
class StopResult:
    stopped: list[str] = field(default_factory=list)
    ended: dict[str, str] = field(default_factory=dict)   # id -> how it had already ended


def stop(cluster: Cluster, job_ids: list[str] | None = None) -> StopResult:
    """Cancel these jobs, or (None) all my tgi-hpc jobs still queued or running. Jobs that had already
    ended are reported as such, not as stopped; unknown ids are an error, after the rest."""
    if job_ids is None:
        known = {j.job_id: j for j in cluster.backend.mine()}
        asked, unknown = list(known), []
    else:
        known = cluster.backend.states(job_ids)
        asked, unknown = [j for j in job_ids if j in known], [j for j in job_ids if j not in known]
    result = StopResult(ended={j: known[j].state for j in asked if known[j].is_final})
    result.stopped = [j for j in asked if j not in result.ended]
    if result.stopped:
        cluster.backend.cancel(result.stopped)
    if unknown:
        done = f" (stopped {' '.join(result.stopped)})" if result.stopped else ""
        raise SlurmError(f"no such job: {' '.join(unknown)}{done}")
    if job_ids is None:
        result.ended = {}       # --all: only what was still running counts
    return result


def failure_cause(cluster: Cluster, job_id: str, lines: int = 12) -> str:
    """The last lines of a failed job's log, the error lines first in mind: what to show on FAILED."""
    try:
        text = cluster.runner.read_file(log_path(cluster.job_dir, job_id))
    except OSError:
        return ""
    tail = [line for line in text.splitlines() if line.strip()][-lines:]
    return "\n".join(f"  | {line[:300]}" for line in tail)


def last_log_line(cluster: Cluster, job_id: str) -> str:
    try:
        text = cluster.runner.read_file(log_path(cluster.job_dir, job_id))
    except OSError:
        return ""
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1][:200] if lines else ""


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
