"""Slurm commands and their parsers. Pure parsing functions; commands go through a Runner."""
from __future__ import annotations

import re
from dataclasses import dataclass

from tgi_hpc.errors import SlurmError
from tgi_hpc.remote.runner import Runner

# Slurm states that will not change any more.
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL",
                "PREEMPTED", "BOOT_FAIL", "DEADLINE", "REVOKED"}
_JOB_ID = re.compile(r"^(?P<id>\d+(?:_\d+)?)(?:;\S+)?$")
_SQUEUE_FORMAT = "%i|%j|%T|%r|%N|%M|%l|%P"


@dataclass(frozen=True)
class SlurmJob:
    job_id: str
    name: str
    state: str            # Slurm's own word: PENDING, RUNNING, COMPLETED, ...
    reason: str = ""      # why PENDING (Resources, Priority, BeginTime...)
    node: str = ""
    elapsed: str = ""
    time_limit: str = ""
    partition: str = ""

    @property
    def is_final(self) -> bool:
        return self.state in FINAL_STATES


def parse_sbatch(output: str) -> str:
    """`sbatch --parsable` prints `ID` or `ID;cluster`."""
    line = output.strip().splitlines()[-1] if output.strip() else ""
    match = _JOB_ID.match(line.strip())
    if not match:
        raise SlurmError(f"could not read a job id from sbatch's answer: {output!r}")
    return match.group("id")


def parse_squeue(output: str) -> list[SlurmJob]:
    jobs = []
    for line in output.splitlines():
        fields = line.split("|")
        if len(fields) != 8:
            continue
        job_id, name, state, reason, node, elapsed, limit, partition = (f.strip() for f in fields)
        node = "" if node.startswith("(") else node
        reason = "" if reason in ("None", "(null)") else reason.strip("()")
        jobs.append(SlurmJob(job_id, name, state.split()[0], reason, node, elapsed, limit, partition))
    return jobs


def parse_sacct(output: str) -> list[SlurmJob]:
    """Allocation lines of `sacct -P -o JobID,JobName,State,NodeList,Elapsed,Timelimit,Partition`."""
    # submitit's parser handles the header, array ids and skips steps (.batch, .extern, .0).
    from submitit.slurm.slurm import SlurmInfoWatcher

    info = SlurmInfoWatcher.read_info(None, output)  # type: ignore[arg-type]
    jobs = []
    for job_id, row in info.items():
        state = row.get("State", "").split()[0] if row.get("State") else "UNKNOWN"
        node = row.get("NodeList", "")
        jobs.append(SlurmJob(job_id, row.get("JobName", ""), state, "",
                             "" if node in ("None assigned", "(null)") else node,
                             row.get("Elapsed", ""), row.get("Timelimit", ""), row.get("Partition", "")))
    return jobs


def _check(result, what: str) -> str:
    if result.returncode != 0:
        raise SlurmError(f"{what} failed (exit {result.returncode}): {result.stderr.strip() or result.stdout.strip()}")
    return result.stdout


def submit(runner: Runner, script_path: str, cwd: str, env: dict[str, str] | None = None) -> str:
    """sbatch from `cwd` (scratch): some clusters refuse jobs submitted from $HOME (Trillium, Cedar)."""
    argv = ["env", "-C", cwd, "sbatch", "--parsable", script_path]
    return parse_sbatch(_check(runner.run(argv, env=env), "sbatch"))


def squeue(runner: Runner, job_ids: list[str] | None = None) -> list[SlurmJob]:
    argv = ["squeue", "-h", "-t", "all", "-o", _SQUEUE_FORMAT]
    argv += ["-j", ",".join(job_ids)] if job_ids else ["--me"]
    result = runner.run(argv)
    if result.returncode != 0 and job_ids and "Invalid job id" in result.stderr:
        return []  # squeue forgets finished jobs after MinJobAge: sacct still knows them
    return parse_squeue(_check(result, "squeue"))


def sacct(runner: Runner, job_ids: list[str]) -> list[SlurmJob]:
    argv = ["sacct", "-P", "-X", "-o", "JobID,JobName,State,NodeList,Elapsed,Timelimit,Partition",
            "-j", ",".join(job_ids)]
    result = runner.run(argv)
    if result.returncode != 0:  # accounting may be off: not fatal, squeue already answered
        return []
    return parse_sacct(result.stdout)


def job_states(runner: Runner, job_ids: list[str]) -> dict[str, SlurmJob]:
    """One squeue call for all jobs, then sacct for those squeue no longer shows."""
    found = {job.job_id: job for job in squeue(runner, job_ids)}
    missing = [j for j in job_ids if j not in found]
    if missing:
        found.update({job.job_id: job for job in sacct(runner, missing)})
    return found


def cancel(runner: Runner, job_ids: list[str]) -> None:
    _check(runner.run(["scancel", *job_ids]), "scancel")
