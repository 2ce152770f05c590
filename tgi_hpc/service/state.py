"""The service state file: `<jobs>/services/<name>.json`, one per service, never one per job.

Writers: the CLI creates it (before any of its jobs can run: they are submitted held), each job
updates its own entry and records its successor (`locked()`: a lease lock that holds across nodes, see
lease_lock.py, + atomic replace), `stop` drops a
`<name>.stopped` marker. Readers (tunnel, `endpoint`, client) read it whole, without the lock.
"""
from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tgi_hpc.errors import UsageError
from tgi_hpc.files import write_atomic
from tgi_hpc.service.lease_lock import LEASE_S, LeaseLock

_JOB_ID = re.compile(r"^\d+(_\d+)?$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
OBSERVATIONS = 5            # queue waits and load times kept for the lead time
LIVE = ("submitted", "starting", "ready", "draining")


def is_job_id(text: str) -> bool:
    """Job ids are digits (an array task: 123_4); a command argument that is not one names a service."""
    return bool(_JOB_ID.match(text))


def check_name(name: str) -> str:
    """A service name is a file name on the cluster: letters, digits, `.`, `_`, `-` (64 at most)."""
    if not isinstance(name, str) or not _NAME.match(name) or name in (".", ".."):
        raise UsageError(f"service name {name!r}: use letters, digits, '.', '_' or '-' (at most 64, "
                         "starting with a letter or digit)")
    return name


def default_name(model: str) -> str:
    """`ORG/NAME` or `/path/to/NAME` -> `name`, made a valid service name."""
    base = model.rstrip("/").rsplit("/", 1)[-1] or "model"
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "-", base).strip("-._").lower()[:64]
    return cleaned or "model"


def services_dir(job_dir: str) -> str:
    return f"{job_dir.rstrip('/')}/services"


def state_path(job_dir: str, name: str) -> str:
    return f"{services_dir(job_dir)}/{check_name(name)}.json"


def stopped_path(state_file: str) -> str:
    return state_file[: -len(".json")] + ".stopped"


@dataclass
class Replica:
    """One job of the service. `slot` is the replica number; each generation replaces its predecessor."""

    job_id: str
    slot: int = 0
    generation: int = 0
    state: str = "submitted"      # submitted | starting | ready | draining | ended
    submitted_at: float = 0.0
    begin_at: float = 0.0         # when Slurm may start it (--begin / --dependency), else submitted_at
    started_at: float = 0.0
    ready_at: float = 0.0
    ends_at: float = 0.0          # its time limit, as a Unix time
    node: str = ""
    url: str = ""                 # http://host:port once ready
    predecessor: str = ""
    successor: str = ""
    submitting: str = ""          # "TOKEN HOST PID TIME": a successor's sbatch under way (see handover.py)

    @property
    def is_live(self) -> bool:
        return self.state in LIVE


@dataclass
class ServiceState:
    name: str
    model: str = ""
    replicas: int = 1
    handover: bool = False
    lead_s: float | None = None   # --handover LEAD; None = from the observations below
    lead_floor_s: float = 300.0
    submit_by: str = "begin"      # begin | dependency | at_lead (profile: slurm.handover_submit)
    script: str = ""              # the job script every generation is submitted from
    api_key_file: str = ""        # one key for all replicas ("" = no key)
    created_at: float = 0.0
    queue_waits: list[float] = field(default_factory=list)
    load_times: list[float] = field(default_factory=list)
    jobs: list[Replica] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ServiceState:
        data = json.loads(text)
        if not isinstance(data, dict) or "name" not in data:
            raise ValueError("not a service state")
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__ and k != "jobs"}
        fields = Replica.__dataclass_fields__
        jobs = [Replica(**{k: v for k, v in job.items() if k in fields}) for job in data.get("jobs", [])]
        return cls(**known, jobs=jobs)

    def job(self, job_id: str) -> Replica | None:
        return next((j for j in self.jobs if j.job_id == job_id), None)

    def live(self) -> list[Replica]:
        return [j for j in self.jobs if j.is_live]

    def serving(self) -> list[Replica]:
        """Replicas a new connection may go to: READY, not draining, with a published URL."""
        return [j for j in self.jobs if j.state == "ready" and j.url]

    def observe(self, queue_wait_s: float | None = None, load_s: float | None = None) -> None:
        if queue_wait_s is not None and queue_wait_s >= 0:
            self.queue_waits = (self.queue_waits + [round(queue_wait_s, 1)])[-OBSERVATIONS:]
        if load_s is not None and load_s >= 0:
            self.load_times = (self.load_times + [round(load_s, 1)])[-OBSERVATIONS:]

    def prune(self, keep_ended: int = 20) -> None:
        """Ended jobs are history: keep the newest few so the file stays small."""
        ended = [j for j in self.jobs if not j.is_live]
        drop = {id(j) for j in ended[:-keep_ended]} if len(ended) > keep_ended else set()
        self.jobs = [j for j in self.jobs if id(j) not in drop]


def read_state(path: str | Path, name: str = "") -> ServiceState:
    """The state as last written; UsageError naming the service when there is none."""
    try:
        return ServiceState.from_json(Path(path).read_text())
    except FileNotFoundError:
        raise UsageError(f"no service {name or Path(path).stem!r} (no {path}); start one with "
                         "`tgi-hpc serve --service NAME ...`") from None


def parse_state(text: str, where: str) -> ServiceState:
    try:
        return ServiceState.from_json(text)
    except (ValueError, TypeError) as exc:
        raise UsageError(f"{where} is not a service state file ({exc})") from None


@contextlib.contextmanager
def locked(path: str | Path, lease_s: float = LEASE_S) -> Iterator[ServiceState]:
    """Read-modify-write under a lock that excludes across nodes (the jobs of a service run on several;
    `flock` on Lustre with localflock would not); the new state replaces the file atomically, so
    readers without the lock never see half of it."""
    path = Path(path)
    with LeaseLock(path.with_suffix(".lock"), lease_s=lease_s):
        state = read_state(path)
        yield state
        state.prune()
        write_atomic(path, state.to_json() + "\n", mode=0o600)


def is_stopped(path: str | Path) -> bool:
    return Path(stopped_path(str(path))).exists()


def now() -> float:
    return time.time()
