"""Runner: where Slurm commands and job files live. LocalRunner here; SSHRunner (tgi_hpc.remote.ssh_runner) for the laptop."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Protocol

from tgi_hpc.errors import SlurmError
from tgi_hpc.files import write_atomic
from tgi_hpc.quoting import sh_env


class Runner(Protocol):
    def run(self, argv: list[str], *, input: str | None = None, env: dict[str, str] | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess[str]: ...
    def write_file(self, path: str, text: str, mode: int = 0o600) -> None: ...
    def read_file(self, path: str) -> str: ...
    def close(self) -> None: ...


class LocalRunner:
    """Runs commands on this host (a login node, or the test machine). Never through a shell."""

    def run(self, argv: list[str], *, input: str | None = None, env: dict[str, str] | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess[str]:
        full_env = {**os.environ, **(env or {})}
        try:
            return subprocess.run(argv, input=input, env=full_env, capture_output=True, text=True, timeout=timeout)
        except FileNotFoundError as exc:
            raise SlurmError(f"`{argv[0]}` is not installed on this host: is this a Slurm login node? "
                             "(use --cluster local to run without Slurm)") from exc
        except subprocess.TimeoutExpired as exc:
            raise SlurmError(f"`{' '.join(argv[:2])}` did not answer within {timeout:.0f} s") from exc

    def write_file(self, path: str, text: str, mode: int = 0o600) -> None:
        write_atomic(Path(path), text, mode=mode)

    def read_file(self, path: str) -> str:
        return Path(path).read_text()

    def close(self) -> None:
        pass


def expand_path(runner: Runner, path: str) -> str:
    """Expand a profile path's $VARS where the jobs run (the login node), e.g. $SCRATCH."""
    if "$" not in path:
        return path
    result = runner.run(["bash", "-c", f"set -u; printf %s {sh_env(path)}"], timeout=30)
    if result.returncode != 0:
        raise SlurmError(f"cannot expand {path!r} on the cluster: {result.stderr.strip()} "
                         "(set the variable, or override the path with --set paths....=DIR)")
    return result.stdout
