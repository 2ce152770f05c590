"""Fixtures for tests against the real local Slurm cluster and sshd.

The cluster is started once per test run by `scripts/local-cluster/start.sh` (root; it
writes $TGI_HPC_CLUSTER_DIR/env.sh), never by these fixtures. When it is down the tests
are skipped, or fail when TGI_HPC_REQUIRE_CLUSTER=1 (CI), with the command that starts it.
Every test in tests/cluster/ gets `pytest.mark.cluster`.
"""
from __future__ import annotations

import os
import shlex
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
START = HERE.parents[1] / "scripts" / "local-cluster" / "start.sh"
DEFAULT_DIR = "/tmp/tgi-hpc-cluster"
# States after which a job never runs again on its own (PREEMPTED and NODE_FAIL are left out:
# a requeueable job passes through them on its way back to PENDING).
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
USABLE_NODE = {"idle", "mixed", "allocated", "completing", "planned"}


def pytest_collection_modifyitems(items):
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.cluster)


def read_env_file(path: Path) -> dict[str, str]:
    """The `export K=V` lines of the env file written by start.sh."""
    env = {}
    for line in path.read_text().splitlines():
        if line.startswith("export "):
            key, _, value = line[len("export "):].partition("=")
            env[key] = " ".join(shlex.split(value))
    return env


@dataclass
class LocalCluster:
    """The running local cluster, as described by its env file; commands run against it."""

    state_dir: Path
    env: dict[str, str]          # os.environ plus env.sh: pass to subprocesses
    slurm_conf: Path
    node: str
    partitions: list[str]
    accounts: list[str]
    default_account: str
    enforce_accounts: bool       # unknown --account rejected at submit
    gpus: int
    gpu_type: str
    tmpdir_root: Path            # SLURM_TMPDIR = tmpdir_root/<job id>
    ssh_config: Path
    ssh_key: Path
    known_hosts: Path
    ssh_port: int
    slurmctld_port: int
    login: str                   # ssh alias of the login node (compute nodes: ProxyJump via it)
    profile: Path = field(default=HERE / "local-profile.yaml")

    @classmethod
    def from_state_dir(cls, state_dir: Path) -> "LocalCluster":
        values = read_env_file(state_dir / "env.sh")
        return cls(
            state_dir=state_dir,
            env={**os.environ, **values},
            slurm_conf=Path(values["SLURM_CONF"]),
            node=values["TGI_HPC_CLUSTER_NODE"],
            partitions=values["TGI_HPC_CLUSTER_PARTITIONS"].split(),
            accounts=values["TGI_HPC_CLUSTER_ACCOUNTS"].split(),
            default_account=values["TGI_HPC_CLUSTER_DEFAULT_ACCOUNT"],
            enforce_accounts=bool(values.get("TGI_HPC_CLUSTER_ENFORCE")),
            gpus=int(values["TGI_HPC_CLUSTER_GPUS"]),
            gpu_type=values["TGI_HPC_CLUSTER_GPU_TYPE"],
            tmpdir_root=Path(values["TGI_HPC_CLUSTER_TMPDIR_ROOT"]),
            ssh_config=Path(values["TGI_HPC_CLUSTER_SSH_CONFIG"]),
            ssh_key=Path(values["TGI_HPC_CLUSTER_SSH_KEY"]),
            known_hosts=Path(values["TGI_HPC_CLUSTER_KNOWN_HOSTS"]),
            ssh_port=int(values["TGI_HPC_CLUSTER_SSH_PORT"]),
            slurmctld_port=int(values["TGI_HPC_CLUSTER_PORT_BASE"]),
            login=values["TGI_HPC_CLUSTER_LOGIN"],
        )

    def run(self, *argv: str, check: bool = True, timeout: float = 30, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(argv, env=self.env, capture_output=True, text=True, check=check,
                              timeout=timeout, **kwargs)

    def sbatch(self, *args: str, cwd: Path | None = None) -> str:
        """Submit (sbatch --parsable ARGS) and return the job id."""
        out = self.run("sbatch", "--parsable", *args, cwd=cwd).stdout.strip()
        return out.split(";")[0]

    def ssh(self, host: str, command: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return self.run("ssh", "-F", str(self.ssh_config), host, command, check=False, timeout=timeout)

    def state(self, job_id: str) -> str:
        """Current state from squeue (-t all: finished ones too), else from sacct."""
        out = self.run("squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T", check=False).stdout.strip()
        return out or self.sacct_state(job_id)

    def sacct_state(self, job_id: str) -> str:
        out = self.run("sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State", check=False).stdout
        # "CANCELLED by 0" -> "CANCELLED"; empty until slurmdbd has the record
        return out.split("\n")[0].split(" ")[0].strip()

    def wait_for_state(self, job_id: str, states: set[str] | str, timeout: float = 30,
                       source: str = "squeue") -> str:
        """Poll until the job is in one of `states`; fail early on another final state."""
        states = {states} if isinstance(states, str) else set(states)
        read = self.sacct_state if source == "sacct" else self.state
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            state = read(job_id)
            if state in states:
                return state
            if state in FINISHED and source != "sacct":
                break
            time.sleep(0.2)
        detail = self.run("scontrol", "show", "job", job_id, check=False).stdout
        raise AssertionError(f"job {job_id} is {state or 'unknown'} ({source}), wanted {sorted(states)}"
                             f" within {timeout:.0f} s\n{detail}")

    def show_job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job -o` as a dict (keys like JobState, Restarts, Account)."""
        out = self.run("scontrol", "show", "job", "-o", job_id).stdout
        return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)

    def cancel(self, *job_ids: str) -> None:
        self.run("scancel", *job_ids, check=False)


def port_closed(port: int) -> str | None:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except OSError as exc:
        return str(exc)
    return None


def cluster_down_reason(state_dir: Path) -> str | None:
    """None when the cluster in state_dir answers (node usable, sshd listening), else why not."""
    env_file = state_dir / "env.sh"
    if not env_file.exists():
        return f"{env_file} not found"
    try:
        cluster = LocalCluster.from_state_dir(state_dir)
    except (KeyError, ValueError) as exc:
        return f"{env_file} is incomplete ({exc!r}): re-run start.sh"
    # Port checks first: sinfo retries a dead controller for 10 s before it gives up.
    for name, port in (("slurmctld", cluster.slurmctld_port), ("sshd", cluster.ssh_port)):
        if error := port_closed(port):
            return f"{name} not listening on 127.0.0.1:{port} ({error})"
    try:
        node = cluster.run("sinfo", "-h", "-n", cluster.node, "-o", "%T", check=False, timeout=15)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot query the cluster: {exc!r}"
    state = (node.stdout.split() or [""])[0]
    if state not in USABLE_NODE:
        return f"node {cluster.node} is {state or node.stderr.strip()!r}"
    return None


@pytest.fixture(name="cluster_down_reason", scope="session")
def _cluster_down_reason():
    """The up-check itself (tests can point it at a state dir with no cluster)."""
    return cluster_down_reason


@pytest.fixture(scope="session")
def local_cluster() -> LocalCluster:
    state_dir = Path(os.environ.get("TGI_HPC_CLUSTER_DIR", DEFAULT_DIR))
    reason = cluster_down_reason(state_dir)
    if reason:
        message = (f"local Slurm cluster is not running: {reason}. Start it (as root) with "
                   f"`{START}`, then re-run (TGI_HPC_CLUSTER_DIR={state_dir}).")
        if os.environ.get("TGI_HPC_REQUIRE_CLUSTER") == "1":
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    return LocalCluster.from_state_dir(state_dir)
