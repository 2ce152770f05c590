"""One successor per job: the intent a submitter records, under the state lock, before its `sbatch`.

`watch` and the SIGTERM trap's `term` are separate processes of one job, and both may submit the
job's successor. The first records `TOKEN HOST PID TIME` in the job's entry, submits with
`--comment=tgi-hpc-successor-TOKEN`, then records the job id. A second attempt that sees the intent
waits for the id. An intent whose submitter is gone (its pid died on this node, it is overdue, or its
sbatch failed or timed out: pid 0) is settled by asking Slurm for a job with that comment: adopted
when there is one, submitted again when there is none, and left alone when Slurm does not answer.
"""
from __future__ import annotations

import getpass
import os
import secrets
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

TIMEOUT_S = 180.0   # sbatch's own timeout (60 s) and a busy controller's retries: then a submitter is overdue
COMMENT = "tgi-hpc-successor-"


@dataclass(frozen=True)
class Intent:
    token: str
    host: str
    pid: int       # 0: the submitter gave up without knowing whether its sbatch got through
    at: float

    @classmethod
    def mine(cls) -> Intent:
        return cls(secrets.token_hex(8), socket.gethostname(), os.getpid(), time.time())

    @classmethod
    def parse(cls, text: object) -> Intent | None:
        parts = text.split() if isinstance(text, str) else []
        if len(parts) != 4:
            return None
        try:
            return cls(parts[0], parts[1], int(parts[2]), float(parts[3]))
        except ValueError:
            return None

    def __str__(self) -> str:
        return f"{self.token} {self.host} {self.pid} {self.at:.3f}"

    @property
    def comment(self) -> str:
        return COMMENT + self.token

    def outcome_unknown(self) -> Intent:
        return replace(self, pid=0)

    def submitter_gone(self, now: float, timeout_s: float = TIMEOUT_S) -> bool:
        if self.pid == 0 or now - self.at > timeout_s:
            return True
        if self.host != socket.gethostname():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False


def find_submitted(intent: Intent, run: Callable[[list[str]], subprocess.CompletedProcess[str]]) -> str | None:
    """The id of the job submitted for `intent` ("" when Slurm knows none); None when Slurm does not answer."""
    result = run(["squeue", "-h", "-t", "all", "-u", getpass.getuser(), "-o", "%i %k"])
    if result.returncode != 0:
        return None
    for line in result.stdout.splitlines():
        job_id, _, comment = line.strip().partition(" ")
        if comment.strip() == intent.comment:
            return job_id
    return ""
