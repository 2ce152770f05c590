"""Inside a service's job (`python -m tgi_hpc.slurm.job service watch|term|exit`): the handover.

Everything runs in the job itself, on its compute node: no daemon on a login node, and the laptop only
reads the state. `watch` (started beside the engine) records the job in the service's state file, marks
it ready once the engine answers, submits the successor so that it is READY before this job's time limit
(lead = observed queue wait + load time, with a floor; `--begin`, `--dependency=after:` or a plain
submission at the lead, per the profile's `slurm.handover_submit`), then, once the successor is READY,
marks itself draining and sends the engine SIGTERM. `term` runs from the job's SIGTERM trap (time limit,
scancel, preemption): the successor may start at once. `exit` marks the job ended (after the same release
when the engine ended on its own, e.g. a crash).
"""
from __future__ import annotations

import logging
import math
import os
import shutil
import signal
import subprocess
import time
from datetime import datetime
from pathlib import Path

from tgi_hpc.service.lead import lead_time, plan
from tgi_hpc.service.state import Replica, ServiceState, is_stopped, locked, read_state
from tgi_hpc.slurm.commands import FINAL_STATES, parse_sbatch
from tgi_hpc.slurm.endpoint import Endpoint
from tgi_hpc.slurm.successor_intent import Intent, find_submitted

logger = logging.getLogger(__name__)

SLOT_ENV, GENERATION_ENV = "TGI_HPC_SERVICE_SLOT", "TGI_HPC_SERVICE_GENERATION"
SWITCH_S = 3.0        # between "draining" in the state and SIGTERM: balancers re-read the state every 2 s
POLL_S = 2.0
INTENT_POLL_S = 0.5  # while another process of the job submits the successor
MAX_RETRIES = 3       # successors that die before READY are replaced this many times per generation


def _run(argv: list[str], **kwargs) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, **kwargs)


def _unix(value: str) -> float:
    try:
        return datetime.strptime(value, "%Y-%m-%dT%H:%M:%S").timestamp()   # the controller's local time
    except ValueError:
        return 0.0   # Unknown, None, (null)


def slurm_times(job_id: str, attempts: int = 5) -> dict[str, float]:
    """SubmitTime, EligibleTime, StartTime, EndTime of a job (0 when unknown), from `scontrol show job`;
    asked again when the controller does not answer (without an end time there is no handover)."""
    for attempt in range(attempts):
        out = _run(["scontrol", "show", "job", "-o", job_id]).stdout
        fields = dict(kv.split("=", 1) for kv in out.split() if "=" in kv)
        times = {k: _unix(fields.get(k, "")) for k in ("SubmitTime", "EligibleTime", "StartTime", "EndTime")}
        if times["EndTime"] or attempt == attempts - 1:
            return times
        time.sleep(2.0)
    return times


def _sbatch_env(slot: int, generation: int) -> dict[str, str]:
    """This job's environment minus what Slurm set for it: a successor must not inherit SLURM_MEM_*,
    SLURM_JOB_ID or a hold (SBATCH_HOLD)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SBATCH_", "SALLOC_")) or k == "SLURM_CONF"}
    env.pop("TGI_HPC_JOB_ID", None)
    return {**env, SLOT_ENV: str(slot), GENERATION_ENV: str(generation)}


def submission_flags(submit_by: str, delay_s: float, predecessor: Replica, now: float) -> list[str]:
    """sbatch flags that keep the successor from starting before `now + delay_s`."""
    if delay_s <= 0:
        return []
    if submit_by == "begin":
        return [f"--begin=now+{int(delay_s)}"]
    if submit_by == "dependency":   # after:JOB+MINUTES counts from the predecessor's start; early, not late
        minutes = math.floor((now + delay_s - predecessor.started_at) / 60)
        return [f"--dependency=after:{predecessor.job_id}+{max(1, minutes)}"]
    return []


def submit_successor(state_file: str, me: Replica, delay_s: float) -> str | None:
    """Submit the next generation of `me`'s slot and record it, once however many processes ask (see
    successor_intent.py): the live successor already recorded, if any; None when the service was stopped."""
    return _successor(state_file, me, delay_s)[0]


def _successor(state_file: str, me: Replica, delay_s: float) -> tuple[str | None, bool]:
    """(successor id or None, whether this call submitted it)."""
    intent = Intent.mine()
    while True:
        if is_stopped(state_file):
            return None, False
        verdict, other = _claim(state_file, me.job_id, intent)
        if verdict == "existing":
            return other, False
        if verdict == "claimed":
            break
        if verdict == "gone":
            return None, False
        if verdict == "stale":
            found = find_submitted(other, _run)
            if found is None:   # a busy controller: no verdict, never a duplicate successor
                logger.warning("successor of job %s: an earlier sbatch's outcome is unknown and squeue does not "
                               "answer: not submitting another", me.job_id)
                return None, False
            _settle(state_file, me, other, found)
            continue
        time.sleep(INTENT_POLL_S)   # another process is submitting it: wait for its id
    return _submit(state_file, me, delay_s, intent), True


def _claim(state_file: str, job_id: str, intent: Intent) -> tuple[str, object]:
    """Under the lock: ("existing", id) | ("claimed", None) | ("busy"|"stale", other intent) | ("gone", None)."""
    with locked(state_file) as st:
        mine = st.job(job_id)
        if mine is None:
            return "gone", None
        succ = st.job(mine.successor) if mine.successor else None
        if succ is not None and succ.is_live:
            return "existing", succ.job_id
        other = Intent.parse(mine.submitting)
        if other is None:
            mine.submitting = str(intent)
            return "claimed", None
        return ("stale" if other.submitter_gone(time.time()) else "busy"), other


def _settle(state_file: str, me: Replica, stale: Intent, found: str) -> None:
    """A stale intent: adopt the job Slurm has for it, or forget it (unless another process did first)."""
    with locked(state_file) as st:
        mine = st.job(me.job_id)
        if mine is None or mine.submitting != str(stale):
            return
        mine.submitting = ""
        if found:
            logger.info("job %s: adopting successor %s, submitted by a process that did not record it", me.job_id, found)
            if st.job(found) is None:
                st.jobs.append(Replica(found, slot=me.slot, generation=me.generation + 1, submitted_at=stale.at,
                                       begin_at=stale.at, predecessor=me.job_id))
            mine.successor = found


def _submit(state_file: str, me: Replica, delay_s: float, intent: Intent) -> str | None:
    st = read_state(state_file)
    now = time.time()
    flags = submission_flags(st.submit_by, delay_s, me, now)
    job_dir = str(Path(state_file).parent.parent)
    try:
        result = _run(["sbatch", "--parsable", f"--comment={intent.comment}", *flags, st.script], cwd=job_dir,
                      env=_sbatch_env(me.slot, me.generation + 1))
    except BaseException:
        _give_up(state_file, me.job_id, intent)
        raise
    if result.returncode != 0:
        logger.error("could not submit the successor of job %s: %s", me.job_id, result.stderr.strip())
        _give_up(state_file, me.job_id, intent)
        return None
    job_id = parse_sbatch(result.stdout)
    shutil.copyfile(st.script, f"{job_dir}/{job_id}.sbatch")   # where `tgi-hpc status/logs` look for it
    with locked(state_file) as st:
        st.jobs.append(Replica(job_id, slot=me.slot, generation=me.generation + 1, submitted_at=now,
                               begin_at=now + (delay_s if flags else 0), predecessor=me.job_id))
        mine = st.job(me.job_id)
        if mine:
            mine.successor = job_id
            if mine.submitting == str(intent):
                mine.submitting = ""
    if is_stopped(state_file):   # `stop` ran while we submitted: do not leave it behind
        _run(["scancel", job_id])
        return None
    logger.info("submitted successor %s of job %s (%s)", job_id, me.job_id, " ".join(flags) or "no delay")
    return job_id


def _give_up(state_file: str, job_id: str, intent: Intent) -> None:
    """The sbatch failed or timed out, and may still have got through: the next attempt asks Slurm first."""
    with locked(state_file) as st:
        mine = st.job(job_id)
        if mine is not None and mine.submitting == str(intent):
            mine.submitting = str(intent.outcome_unknown())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def register(state_file: str, job_id: str) -> Replica:
    """This job's entry: started now, ends at its time limit; its queue wait is an observation."""
    times = slurm_times(job_id)
    started = times["StartTime"] or time.time()
    with locked(state_file) as st:
        me = st.job(job_id)
        if me is None:   # submitted by hand from the service script
            me = Replica(job_id, slot=int(os.environ.get(SLOT_ENV, "0") or 0),
                         generation=int(os.environ.get(GENERATION_ENV, "0") or 0), submitted_at=times["SubmitTime"])
            st.jobs.append(me)
        me.state, me.started_at, me.ends_at = "starting", started, times["EndTime"]
        eligible = max(times["EligibleTime"], times["SubmitTime"])   # Slurm's clock: --begin and holds included
        if eligible:
            st.observe(queue_wait_s=max(0.0, started - eligible))
        return Replica(**vars(me))


def mark_ready(state_file: str, job_id: str, endpoint: Endpoint) -> tuple[ServiceState, Replica]:
    now = time.time()
    with locked(state_file) as st:
        me = st.job(job_id)
        me.state, me.ready_at, me.url, me.node = "ready", now, endpoint.url, endpoint.node
        st.observe(load_s=now - me.started_at)
        return st, Replica(**vars(me))


def set_state(state_file: str, job_id: str, state: str) -> Replica | None:
    with locked(state_file) as st:
        me = st.job(job_id)
        if me is not None and (me.state != "ended" or state == "ended"):
            me.state = state
        return Replica(**vars(me)) if me else None


def _wait_endpoint(path: Path, pid: int) -> Endpoint | None:
    while _alive(pid):
        try:
            return Endpoint.from_json(path.read_text())
        except (OSError, ValueError, KeyError, TypeError):
            time.sleep(0.5)
    return None


def _wait_ready(endpoint: Endpoint, api_key_file: str, pid: int) -> bool:
    from tgi_hpc.slurm.readiness import probe

    key = Path(api_key_file).read_text().strip() if api_key_file else None
    while _alive(pid):
        if probe(endpoint.url, key).ready:
            return True
        time.sleep(1.0)
    return False


def _load_adapters(state_file: str, endpoint: Endpoint, loaded: set[str]) -> set[str]:
    """The adapters `tgi-hpc adapter load` recorded for the service (service.adapters), into this job's engine."""
    from tgi_hpc.service.adapters import load_recorded, record_path

    key_file = read_state(state_file).api_key_file
    key = Path(key_file).read_text().strip() if key_file else None
    for name in load_recorded(endpoint.url, key, record_path(state_file), loaded):
        logger.info("adapter %s loaded, as the service records", name)
    return loaded


def _successor_state(state_file: str, job_id: str) -> str:
    succ = read_state(state_file).job(job_id)
    if succ is None:
        return "gone"
    if succ.state == "submitted":   # not started yet: did Slurm end it (failed, cancelled)?
        result = _run(["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T"])
        if result.returncode != 0:   # a busy controller: no verdict, never a duplicate successor
            return succ.state
        out = result.stdout.strip()
        if out.split(" ")[0] in FINAL_STATES or not out:
            return "failed"
    return succ.state


def watch(state_file: str, job_id: str, endpoint_file: Path, pid: int) -> int:
    """The job's whole service life, beside its engine (see the module docstring)."""
    me = register(state_file, job_id)
    endpoint = _wait_endpoint(endpoint_file, pid)
    if endpoint is None or not _wait_ready(endpoint, read_state(state_file).api_key_file, pid):
        logger.error("the engine of job %s exited before it was ready", job_id)
        return 1
    loaded = _load_adapters(state_file, endpoint, set())
    st, me = mark_ready(state_file, job_id, endpoint)
    logger.info("job %s is ready in service %s at %s", job_id, st.name, endpoint.url)
    _load_adapters(state_file, endpoint, loaded)     # recorded while it was marked: no READY replica lacks one
    if not st.handover or not me.ends_at or is_stopped(state_file):
        return 0
    lead = lead_time(st.queue_waits, st.load_times, st.lead_floor_s, st.lead_s)
    when = plan(me.ends_at, time.time(), lead)
    logger.info("handover: lead %.0f s (queue waits %s, load times %s); the successor may start in %.0f s%s",
                lead, st.queue_waits, st.load_times, when.delay_s, " (late: at once)" if when.late else "")
    if st.submit_by == "at_lead":
        deadline = time.time() + when.delay_s
        while time.time() < deadline and _alive(pid) and not is_stopped(state_file):
            time.sleep(min(POLL_S, max(0.0, deadline - time.time())))
        when = plan(me.ends_at, time.time(), lead)
    if not _alive(pid):
        return 0
    successor = submit_successor(state_file, me, when.delay_s)
    retries, last_check = 0, time.monotonic()
    while successor and _alive(pid) and not is_stopped(state_file):
        time.sleep(POLL_S)
        succ = read_state(state_file).job(successor)
        if succ is not None and succ.state == "ready":
            return hand_over(state_file, job_id, pid, successor)
        if time.monotonic() - last_check < 15:   # squeue from every job every 2 s would load the controller
            continue
        last_check = time.monotonic()
        state = _successor_state(state_file, successor)
        if state in ("failed", "gone", "ended") and retries < MAX_RETRIES:
            logger.warning("successor %s ended before it was ready: submitting another", successor)
            set_state(state_file, successor, "ended")
            retries += 1
            successor = submit_successor(state_file, me, 0)
    return 0


def hand_over(state_file: str, job_id: str, pid: int, successor: str) -> int:
    logger.info("successor %s is ready: job %s drains", successor, job_id)
    set_state(state_file, job_id, "draining")
    time.sleep(SWITCH_S)
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    return 0


def on_term(state_file: str, job_id: str) -> int:
    """From the SIGTERM trap: this job is going away (time limit, scancel, preemption). Unless the
    service was stopped, its successor may start now (or is submitted now)."""
    me = set_state(state_file, job_id, "draining")
    st = read_state(state_file)
    if me is None or not st.handover or is_stopped(state_file):
        return 0
    succ = st.job(me.successor) if me.successor else None
    if succ is None or not succ.is_live:
        if not me.ready_at:   # never READY: no chain of jobs that never load
            return 0
        successor, submitted_here = _successor(state_file, me, 0)
        if successor is None or submitted_here:
            return 0
        succ = read_state(state_file).job(successor)   # `watch` submitted it meanwhile, maybe with a delay
    if succ is not None and succ.state == "submitted":
        _run(["scontrol", "update", f"JobId={succ.job_id}", "StartTime=now"])
        if st.submit_by == "dependency":
            _run(["scontrol", "update", f"JobId={succ.job_id}", "Dependency="])
        logger.info("job %s ends early: successor %s may start at once", job_id, succ.job_id)
    return 0


def main(args) -> int:
    """`python -m tgi_hpc.slurm.job service CMD --state FILE ...` (parsed in tgi_hpc.slurm.job)."""
    job_id = os.environ.get("SLURM_JOB_ID") or os.environ.get("TGI_HPC_JOB_ID", "")
    if args.service_cmd == "watch":
        return watch(args.state, job_id, Path(args.endpoint_file), args.pid)
    if args.service_cmd == "term":
        return on_term(args.state, job_id)
    return on_exit(args.state, job_id)


def on_exit(state_file: str, job_id: str) -> int:
    """The job script's last step. Ending without a handover or a SIGTERM (the engine crashed) is like a
    SIGTERM: the successor may start at once. Then the job is history."""
    me = read_state(state_file).job(job_id)
    if me is not None and me.state == "ready":   # not "starting": a model that never loads must not loop
        on_term(state_file, job_id)
    set_state(state_file, job_id, "ended")
    return 0
