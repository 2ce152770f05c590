"""`--cluster local`: run a rendered job script as a detached process, with Slurm-like bookkeeping.

submitit's LocalExecutor tracks its jobs through the Popen object of the submitting process, so
a later `tgi-hpc status` in another process could not see them; a server must outlive the CLI.
This wrapper keeps the state in files next to the log instead: <jobs>/<id>.state (JSON).
The job id is the wrapper's pid, so the port rule (10000 + last 4 digits) still applies.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tgi_hpc.files import write_atomic


def state_file(job_dir: Path, job_id: str) -> Path:
    return job_dir / f"{job_id}.state"


def write_state(job_dir: Path, job_id: str, state: str, **extra: object) -> None:
    data = {"job_id": job_id, "state": state, "time": time.time(), **extra}
    write_atomic(state_file(job_dir, job_id), json.dumps(data) + "\n", mode=0o644)


def read_state(job_dir: Path, job_id: str) -> dict | None:
    try:
        return json.loads(state_file(job_dir, job_id).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def pid_alive(pid: int) -> bool:
    """Whether `pid` runs; a zombie (exited, not yet reaped by PID 1) counts as gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def start_ticks(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot): a pid reused by another process differs."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[19])
    except (FileNotFoundError, IndexError, ValueError):
        return None


def run(script: Path, job_dir: Path, name: str) -> int:
    job_id = str(os.getpid())
    final = job_dir / f"{job_id}.sbatch"
    script.rename(final)
    tmpdir = job_dir / f"{job_id}.tmp"
    tmpdir.mkdir(mode=0o700, exist_ok=True)
    env = {**os.environ, "TGI_HPC_JOB_ID": job_id, "SLURM_TMPDIR": str(tmpdir), "TGI_HPC_JOB_NAME": name}
    write_state(job_dir, job_id, "RUNNING", name=name, pid=os.getpid(), node=os.uname().nodename,
                start_ticks=start_ticks(os.getpid()))
    with open(job_dir / f"{job_id}.out", "ab", buffering=0) as log:
        child = subprocess.Popen(["bash", str(final)], stdout=log, stderr=log, env=env, start_new_session=True)
    cancelled = False

    def on_term(signum, frame):
        nonlocal cancelled
        cancelled = True
        os.killpg(child.pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    code = child.wait()
    if cancelled:
        try:
            os.killpg(child.pid, signal.SIGKILL)  # whatever the script left behind
        except ProcessLookupError:
            pass
    state = "CANCELLED" if cancelled else ("COMPLETED" if code == 0 else "FAILED")
    write_state(job_dir, job_id, state, name=name, exit_code=code, node=os.uname().nodename)
    return 0


if __name__ == "__main__":
    raise SystemExit(run(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]))
