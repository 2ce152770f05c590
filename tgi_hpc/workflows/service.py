"""Services: `serve --replicas N --handover LEAD` submits the jobs of one named service; `endpoint`,
`tunnel SERVICE` and `stop SERVICE` find its current replicas.

The CLI only creates the state file and submits the first generation (held until the state lists
them, then released); the jobs do the rest (tgi_hpc/slurm/handover.py). Nothing runs on a login node
between commands.
"""
from __future__ import annotations

import secrets
import time
from dataclasses import asdict, dataclass, field, replace

from tgi_hpc.errors import SlurmError, UsageError
from tgi_hpc.profiles.rules import parse_time
from tgi_hpc.quoting import sh
from tgi_hpc.service.balance import Target
from tgi_hpc.service.lead import check_lead
from tgi_hpc.service.state import (Replica, ServiceState, check_name, default_name, parse_state, services_dir,
                                   state_path, stopped_path)
from tgi_hpc.slurm import jobs
from tgi_hpc.slurm.backend import log_path
from tgi_hpc.slurm.cluster import Cluster
from tgi_hpc.slurm.handover import GENERATION_ENV, SLOT_ENV
from tgi_hpc.workflows.serve import ServeOptions, build_serve_spec, check_before_submit, release_dir


@dataclass
class ServiceOptions:
    name: str | None = None        # default: from the model
    replicas: int = 1
    handover: bool = False
    lead: str | None = None        # --handover LEAD (Slurm time or seconds); None = automatic


def lead_seconds(text: str) -> int:
    """`--handover 900`, `15:00` or `0:15:00` (a Slurm time; a bare number is seconds here)."""
    try:
        return int(text) if text.strip().isdigit() else parse_time(text)
    except (ValueError, AttributeError, UsageError):
        raise UsageError(f"--handover {text!r}: give seconds (900) or a Slurm time (15:00, 1:00:00)") from None


def read_service(cluster: Cluster, name: str) -> ServiceState:
    path = state_path(cluster.job_dir, check_name(name))
    try:
        text = cluster.runner.read_file(path)
    except OSError:
        known = list_services(cluster)
        raise UsageError(f"no service {name!r} in {services_dir(cluster.job_dir)}"
                         + (f"; known: {', '.join(known)}" if known else "; start one with `tgi-hpc serve --service`")) from None
    return parse_state(text, path)


def list_services(cluster: Cluster) -> list[str]:
    result = cluster.runner.run(["ls", "-1", services_dir(cluster.job_dir)])
    return sorted(n[: -len(".json")] for n in result.stdout.split() if n.endswith(".json"))


def _service_spec(cluster: Cluster, opts: ServeOptions, svc: ServiceOptions, name: str, dry_run: bool):
    if svc.replicas < 1:
        raise UsageError(f"--replicas {svc.replicas}: a service needs at least one replica")
    if not cluster.uses_slurm:
        raise UsageError("--replicas/--handover/--service need Slurm (a profile with a `slurm:` section)")
    offline = dry_run and not cluster.is_local   # a dry run from a laptop stays offline (no SSH), as serve's
    opts = replace(opts, keep_alive=False, shared_weights=opts.shared_weights and not offline)
    spec = build_serve_spec(cluster, opts, offline=offline)
    slurm = cluster.profile.slurm
    if svc.handover and spec.resources.time:
        limit = parse_time(spec.resources.time)
        if svc.lead:
            check_lead(lead_seconds(svc.lead), limit)
        elif slurm.handover_floor_s >= limit:   # every job would hand over as soon as it is READY
            raise UsageError(f"--keep-alive: the shortest lead (slurm.handover_floor_s = {slurm.handover_floor_s} s) "
                             f"is not shorter than the time limit ({limit} s): give --handover LEAD or a longer --time")
    args = list(spec.engine_args)
    if "--drain-timeout" not in args:   # drained before Slurm's SIGKILL
        args += ["--drain-timeout", str(max(1, slurm.kill_wait_s - 2))]
    path = state_path(cluster.job_dir, name)
    key = f"{services_dir(cluster.job_dir)}/{name}.api-key" if spec.api_key else ""
    return replace(spec, engine_args=tuple(args), service=name, service_state=path, service_key_file=key)


@dataclass
class ServiceResult:
    script: str
    name: str = ""
    state_file: str = ""
    job_ids: list[str] = field(default_factory=list)
    statuses: list[dict] = field(default_factory=list)
    logs: list[str] = field(default_factory=list)
    again: str = ""

    @property
    def job_id(self) -> str | None:
        return self.job_ids[0] if self.job_ids else None

    def to_dict(self) -> dict:
        return {"service": self.name, "state_file": self.state_file, "job_id": self.job_id, "job_ids": self.job_ids,
                "logs": self.logs, "status": self.statuses[0] if self.statuses else None, "statuses": self.statuses}

    def summary(self) -> str:
        lines = [f"service {self.name}: jobs {' '.join(self.job_ids)} submitted", f"  state: {self.state_file}"]
        lines += [f"  {st['job_id']}: {st['state']} at {st['url']}" for st in self.statuses if st.get("url")]
        lines += [f"  clients on the cluster: eval \"$(tgi-hpc endpoint {self.name}{self.again})\"",
                  f"  from a laptop: tgi-hpc tunnel {self.name}{self.again}",
                  f"  stop it: tgi-hpc stop {self.name}{self.again}"]
        return "\n".join(lines)


def run_service(cluster: Cluster, opts: ServeOptions, svc: ServiceOptions, *, release: str | None = None,
                dry_run: bool = False, wait: bool = False, timeout: float = 1800,
                progress=lambda message: None, again: str = "") -> ServiceResult:
    """Create the service's state and submit its first generation: `replicas` jobs, held until the
    state lists them. With `wait`, block until every replica is READY."""
    name = check_name(svc.name or default_name(opts.model))
    spec = _service_spec(cluster, opts, svc, name, dry_run)
    rel = release_dir(cluster, release)
    script = jobs.render(cluster, spec, release_dir=rel)
    if dry_run:
        return ServiceResult(script, name)
    _refuse_running(cluster, name)
    check_before_submit(cluster, spec, rel, explicit_release=release is not None)
    slurm = cluster.profile.slurm
    state = ServiceState(name, model=opts.model, replicas=svc.replicas, handover=svc.handover,
                         lead_s=float(lead_seconds(svc.lead)) if svc.lead else None,
                         lead_floor_s=float(slurm.handover_floor_s), submit_by=slurm.handover_submit,
                         script=f"{services_dir(cluster.job_dir)}/{name}.sbatch",
                         api_key_file=spec.service_key_file, created_at=time.time())
    runner = cluster.runner
    runner.run(["rm", "-f", stopped_path(spec.service_state)])
    runner.write_file(state.script, script, mode=0o600)
    if spec.service_key_file:   # one key for all replicas, made before any of them starts
        try:
            runner.read_file(spec.service_key_file)
        except OSError:
            runner.write_file(spec.service_key_file, secrets.token_urlsafe(32) + "\n", mode=0o600)
    ids = []
    for slot in range(svc.replicas):
        env = {"SBATCH_HOLD": "1", SLOT_ENV: str(slot), GENERATION_ENV: "0"}   # held until the state lists it
        ids.append(cluster.backend.submit(script, spec.name, env=env))
        state.jobs.append(Replica(ids[-1], slot=slot, submitted_at=time.time(), begin_at=time.time()))
    runner.write_file(spec.service_state, state.to_json() + "\n", mode=0o600)
    result = runner.run(["scontrol", "release", *ids])
    if result.returncode != 0:
        raise SlurmError(f"scontrol release {' '.join(ids)} failed: {result.stderr.strip()}")
    progress(f"service {name}: submitted {' '.join(ids)} ({spec.model}, {svc.replicas} replica(s)"
             + (", handover before the time limit)" if svc.handover else ")"))
    out = ServiceResult(script, name, spec.service_state, ids, logs=[log_path(cluster.job_dir, j) for j in ids],
                        again=again)
    if wait:
        for job_id in ids:
            out.statuses.append(jobs.wait(cluster, job_id, until={"READY"}, timeout=timeout,
                                          on_change=lambda s: progress(s.describe()),
                                          on_beat=jobs.heartbeat(progress), again=again).to_dict())
    return out


def _refuse_running(cluster: Cluster, name: str) -> None:
    try:
        current = read_service(cluster, name)
    except UsageError:
        return
    live = [j.job_id for j in current.live()]
    known = cluster.backend.states(live) if live else {}
    running = [j for j in live if j in known and not known[j].is_final]
    if running:
        raise UsageError(f"service {name!r} still has jobs {' '.join(running)}: stop it first "
                         f"(`tgi-hpc stop {name}`) or give another --service name")


@dataclass
class ServiceEndpoint:
    """What a client needs: the serving replicas' URLs and the service's API key."""

    name: str
    state_file: str
    urls: list[str]
    api_key_file: str
    api_key: str | None = None
    jobs: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def exports(self) -> str:
        lines = [f"export TGI_HPC_SERVICE={sh(self.name)}", f"export TGI_HPC_SERVICE_STATE={sh(self.state_file)}",
                 f"export TGI_HPC_URLS={sh(' '.join(self.urls))}",
                 f"export TGI_HPC_URL={sh(self.urls[0] if self.urls else '')}",
                 f"export OPENAI_BASE_URL={sh(self.urls[0] + '/v1' if self.urls else '')}"]
        if self.api_key_file:   # read from the 0600 file by the shell: the key is not printed
            lines += [f"export TGI_HPC_API_KEY_FILE={sh(self.api_key_file)}",
                      f'export TGI_HPC_API_KEY="$(cat {sh(self.api_key_file)})"',
                      'export OPENAI_API_KEY="$TGI_HPC_API_KEY"']
        return "\n".join(lines)


def serving_targets(state: ServiceState) -> list[Target]:
    return [Target.from_url(j.job_id, j.url) for j in state.serving()]


def service_endpoint(cluster: Cluster, name: str, *, check_slurm: bool = True) -> ServiceEndpoint:
    """The service's replicas that take requests now (READY in the state, and running for Slurm)."""
    state = read_service(cluster, name)
    serving = state.serving()
    if check_slurm and serving:
        known = cluster.backend.states([j.job_id for j in serving])
        serving = [j for j in serving if j.job_id in known and not known[j.job_id].is_final]
    return ServiceEndpoint(state.name, state_path(cluster.job_dir, name), [j.url for j in serving],
                           state.api_key_file, service_api_key(cluster, state), [asdict(j) for j in state.live()])


def service_api_key(cluster: Cluster, state: ServiceState) -> str | None:
    """The key every replica of the service accepts (None: no key file, or one that cannot be read)."""
    if not state.api_key_file:
        return None
    try:
        return cluster.runner.read_file(state.api_key_file).strip() or None
    except OSError:
        return None


def stop_service(cluster: Cluster, name: str) -> list[str]:
    """Mark the service stopped (no job submits a successor any more), then cancel its jobs; once
    more a moment later, for a successor submitted while we cancelled."""
    path = state_path(cluster.job_dir, check_name(name))
    read_service(cluster, name)
    cluster.runner.write_file(stopped_path(path), f"{time.time()}\n", mode=0o600)
    stopped: list[str] = []
    for attempt in range(2):
        live = [j.job_id for j in read_service(cluster, name).live() if j.job_id not in stopped]
        known = cluster.backend.states(live) if live else {}
        todo = [j for j in live if j in known and not known[j].is_final]
        if todo:
            cluster.backend.cancel(todo)
            stopped += todo
        if attempt == 0:
            time.sleep(2)
    return stopped


def services_of_jobs(cluster: Cluster, job_ids: list[str]) -> dict[str, tuple[ServiceState, Replica]]:
    """Which of these job ids are live replicas of a service: {job id: (its service's state, replica)}."""
    wanted, found = set(job_ids), {}
    for name in list_services(cluster) if wanted else []:
        try:
            state = read_service(cluster, name)
        except (UsageError, SlurmError):   # a state file removed or unreadable meanwhile: not a member
            continue
        found.update({j.job_id: (state, j) for j in state.live() if j.job_id in wanted})
    return found


def check_replica_stop(cluster: Cluster, job_ids: list[str], *, replica: bool) -> dict[str, str]:
    """`stop JOB` on a service's job would only start its successor (its SIGTERM trap does so), so the
    service goes on: refused, naming `stop SERVICE`. With `--replica` that is the point; returns
    {job id: service} for the jobs that are replaced, not stopped."""
    members = services_of_jobs(cluster, job_ids)
    if replica:
        strays = [j for j in job_ids if j not in members]
        if strays:
            raise UsageError(f"--replica: job {' '.join(strays)} is not a live job of any service; "
                             "drop --replica to stop it")
        fixed = [st.name for st, _ in members.values() if not st.handover]
        if fixed:
            raise UsageError(f"--replica: service {fixed[0]!r} has no handover, so a cancelled replica is not "
                             f"replaced; stop the service (`tgi-hpc stop {fixed[0]}`) and serve it again")
        return {j: st.name for j, (st, _) in members.items()}
    for job_id, (st, rep) in members.items():
        raise UsageError(f"job {job_id} is replica {rep.slot} of service {st.name!r}: cancelling it alone starts "
                         f"its successor and the service keeps running. Stop the service: `tgi-hpc stop {st.name}`; "
                         f"replace just this job: `tgi-hpc stop {job_id} --replica`")
    return {}


def stop_all_services(cluster: Cluster) -> list[str]:
    """Before `stop --all` cancels every job: no service job may submit a successor on its way out."""
    names = list_services(cluster)
    for name in names:
        cluster.runner.write_file(stopped_path(state_path(cluster.job_dir, name)), f"{time.time()}\n", mode=0o600)
    return names
