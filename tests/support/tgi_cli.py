"""`python -m tgi_hpc COMMAND` against the local cluster, with a jobs folder of its own (cluster tests)."""
from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class TgiCli:
    profile: str
    jobs_dir: Path
    env: dict[str, str]

    @classmethod
    def for_cluster(cls, cluster, jobs_dir: Path) -> "TgiCli":
        """`cluster`: the `local_cluster` fixture (its env and profile)."""
        env = {**cluster.env, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        return cls(str(cluster.profile), jobs_dir, env)

    def argv(self, command: str, *args: str) -> list[str]:
        return [sys.executable, "-m", "tgi_hpc", command, "--cluster", self.profile,
                "--set", f"paths.jobs={self.jobs_dir}", *args]

    def __call__(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
        out = subprocess.run(self.argv(*args), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and out.returncode != 0:
            raise AssertionError(f"{args} exited {out.returncode}\n{out.stdout}\n{out.stderr}")
        return out
