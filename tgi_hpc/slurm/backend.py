"""Backends: where a rendered job script runs. Slurm (sbatch/squeue/sacct/scancel) or this host."""
from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Protocol

from tgi_hpc.errors import SlurmError
from tgi_hpc.remote.runner import Runner
from tgi_hpc.slurm import commands as slurm
from tgi_hpc.slurm.commands import SlurmJob
from tgi_hpc.slurm.jobspec import JOB_NAME_PREFIX
from tgi_hpc.slurm.local_job import pid_alive, read_state, start_ticks

OUR_JOB_NAMES = {JOB_NAME_PREFIX + kind for kind in ("serve", "download", "compile", "batch")}


class Backend(Protocol):
    runner: Runner
    job_dir: str

    def submit(self, script: str, name: str, env: dict[str, str] | None = None) -> str: ...
    def states(self, job_ids: list[str]) -> dict[str, SlurmJob]: ...
    def mine(self) -> list[SlurmJob]: ...
    def cancel(self, job_ids: list[str]) -> None: ...


def log_path(job_dir: str, job_id: str) -> str:
    return f"{job_dir.rstrip('/')}/{job_id}.out"


def script_path(job_dir: str, job_id: str) -> str:
    """An array's tasks (4148_2, 4148_[0-3]) share the script of their array (4148.sbatch)."""
    return f"{job_dir.rstrip('/')}/{job_id.split('_')[0]}.sbatch"


class SlurmBackend:
    """Submission with plain sbatch so the rendered script stays the job's source of truth.

    submitit writes its own sbatch file around a pickled callable; a server started by a shell
    script does not fit that model, so we keep submitit for what fits: its sacct parser
    (tgi_hpc.slurm.commands.parse_sacct). Watching is one squeue call for all ids, sacct for the rest.
    """

    def __init__(self, runner: Runner, job_dir: str):
        self.runner, self.job_dir = runner, job_dir

    def submit(self, script: str, name: str, env: dict[str, str] | None = None) -> str:
        self.runner.run(["mkdir", "-p", self.job_dir])
        tmp = f"{self.job_dir.rstrip('/')}/.submit-{secrets.token_hex(6)}.sbatch"
        self.runner.write_file(tmp, script, mode=0o600)
        try:
            job_id = slurm.submit(self.runner, tmp, cwd=self.job_dir, env=env)
        except SlurmError:
            self.runner.run(["rm", "-f", tmp])
            raise
        # sbatch keeps its own copy; ours goes next to the log under the job's id.
        self.runner.run(["mv", tmp, script_path(self.job_dir, job_id)])
        return job_id

    def states(self, job_ids: list[str]) -> dict[str, SlurmJob]:
        return slurm.job_states(self.runner, job_ids)

    def mine(self) -> list[SlurmJob]:
        return [j for j in slurm.squeue(self.runner) if j.name in OUR_JOB_NAMES]

    def cancel(self, job_ids: list[str]) -> None:
        slurm.cancel(self.runner, job_ids)


class LocalBackend:
    """`--cluster local`: the script runs here, detached, under tgi_hpc.slurm.local_job."""

    def __init__(self, runner: Runner, job_dir: str):
        self.runner, self.job_dir = runner, job_dir

    def submit(self, script: str, name: str, env: dict[str, str] | None = None) -> str:
        job_dir = Path(self.job_dir)
        job_dir.mkdir(parents=True, exist_ok=True)
        tmp = job_dir / f".submit-{secrets.token_hex(6)}.sbatch"
        tmp.write_text(script)
        proc = subprocess.Popen(
            [sys.executable, "-m", "tgi_hpc.slurm.local_job", str(tmp), str(job_dir), name],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env={**os.environ, **(env or {})}, start_new_session=True,
        )
        job_id = str(proc.pid)
        deadline = time.monotonic() + 10
        while read_state(job_dir, job_id) is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SlurmError(f"the local job runner did not start (exit {proc.poll()})")
            time.sleep(0.02)
        return job_id

    def _job(self, job_id: str) -> SlurmJob | None:
        data = read_state(Path(self.job_dir), job_id)
        if data is None:
            return None
        state = data["state"]
        pid, ticks = int(data.get("pid", job_id)), data.get("start_ticks")
        if state == "RUNNING" and (not pid_alive(pid) or (ticks is not None and start_ticks(pid) != ticks)):
            state = "FAILED"  # the wrapper died without writing its verdict (its pid may be reused)
        return SlurmJob(job_id, data.get("name", ""), state, node=data.get("node", ""))

    def states(self, job_ids: list[str]) -> dict[str, SlurmJob]:
        return {j: job for j in job_ids if (job := self._job(j)) is not None}

    def mine(self) -> list[SlurmJob]:
        ids = sorted(p.name[: -len(".state")] for p in Path(self.job_dir).glob("*.state"))
        jobs = [self._job(j) for j in ids]
        return [j for j in jobs if j is not None and not j.is_final]

    def cancel(self, job_ids: list[str]) -> None:
        for job_id in job_ids:
            job = self._job(job_id)
            if job is None or job.is_final:
                continue
            try:
                os.kill(int(job_id), signal.SIGTERM)
            except ProcessLookupError:
                pass
