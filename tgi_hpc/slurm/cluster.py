"""A Cluster: the loaded profile plus where commands run (runner) and how jobs run (backend)."""
from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass

from tgi_hpc.errors import SlurmError
from tgi_hpc.profiles.loader import load_profile
from tgi_hpc.profiles.schema import Profile, Resources
from tgi_hpc.remote.runner import LocalRunner, Runner, expand_path
from tgi_hpc.slurm.backend import Backend, LocalBackend, SlurmBackend


@dataclass
class Cluster:
    profile: Profile
    runner: Runner
    backend: Backend
    job_dir: str            # profile.paths.jobs, expanded where the jobs run

    @property
    def uses_slurm(self) -> bool:
        return self.profile.slurm is not None

    @property
    def is_local(self) -> bool:
        """True when this process runs where the jobs' files are (a login node, or no Slurm)."""
        return isinstance(self.runner, LocalRunner)

    def expand(self, path: str, strict: bool = True) -> str:
        if not strict and not self.is_local:
            return path  # see open_cluster: dry runs from a laptop stay offline
        try:
            return expand_path(self.runner, path)
        except SlurmError:
            if strict:
                raise
            return path

    def close(self) -> None:
        self.runner.close()

    def for_job(self, res: Resources) -> Cluster:
        """The cluster as seen from the login node that takes this job (Trillium: CPU jobs from the
        CPU login nodes); itself when that is where we already are."""
        host = submit_host(self.profile, res)
        if self.is_local or host in (None, self.profile.login_host):
            return self
        runner = _ssh_runner(host, access_rules(self.profile),
                             getattr(self.runner, "accept_new_host_key", False))
        return Cluster(self.profile, runner, SlurmBackend(runner, self.job_dir), self.job_dir)


def submit_host(profile: Profile, res: Resources) -> str | None:
    """The login alias a job with `res` is submitted from: `cpu_login_host` for jobs without GPUs when
    the cluster has one, else `login_host`."""
    if not res.gpus and profile.cpu_login_host:
        return profile.cpu_login_host
    return profile.login_host


def _ssh_runner(alias: str, access_rules: tuple[str, ...] = (), accept_host_key: bool = False) -> Runner:
    from tgi_hpc.remote.ssh_runner import SSHRunner  # paramiko only when needed

    return SSHRunner(alias, access_rules=access_rules, accept_new_host_key=accept_host_key)


def access_rules(profile: Profile) -> tuple[str, ...]:
    """The cluster's login rules (profile: access), each with its page, for a failed SSH connection."""
    return tuple(f"{note.text} (source: {note.source})" for note in profile.access)


def _runner_for(profile: Profile, remote: bool | None, accept_host_key: bool = False) -> Runner:
    """Local on a login node; over SSH (one connection) from a laptop."""
    if remote is None:
        remote = os.environ.get("TGI_HPC_REMOTE", "") not in ("", "0") or (
            profile.slurm is not None and profile.login_host is not None and shutil.which("sbatch") is None)
    if not remote:
        return LocalRunner()
    if not profile.login_host:
        raise SlurmError(f"profile {profile.name} has no login_host to reach over SSH")
    return _ssh_runner(profile.login_host, access_rules(profile), accept_host_key)


def open_cluster(name: str | None = None, overrides: Sequence[str] = (), *, remote: bool | None = None,
                 strict_paths: bool = True, accept_host_key: bool = False) -> Cluster:
    profile = load_profile(name, overrides=overrides)
    runner = _runner_for(profile, remote, accept_host_key)
    if not strict_paths and not isinstance(runner, LocalRunner):
        job_dir = profile.paths.jobs  # a dry run from a laptop: no SSH (and no 2FA prompt) just to print
    else:
        try:
            job_dir = expand_path(runner, profile.paths.jobs)
        except SlurmError:
            if strict_paths:
                raise
            job_dir = profile.paths.jobs  # a dry run on another machine: show the unexpanded path
    backend: Backend = SlurmBackend(runner, job_dir) if profile.slurm else LocalBackend(runner, job_dir)
    return Cluster(profile, runner, backend, job_dir)
