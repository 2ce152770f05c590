"""Reaching a serve job from the laptop: open a tunnel to its recorded endpoint, keep background
tunnels in a small registry (the user's state dir), and print what to paste.

The tunnel reuses the SSH connection the Slurm commands use (one 2FA prompt per command) and asks
for the endpoint again after every reconnect, so it follows a requeued job to its new node.
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tgi_hpc.errors import TunnelError, UsageError
from tgi_hpc.files import write_atomic
from tgi_hpc.remote.runner import LocalRunner
from tgi_hpc.slurm import jobs
from tgi_hpc.slurm.cluster import Cluster
from tgi_hpc.slurm.local_job import pid_alive
from tgi_hpc.slurm.ports import is_port_free


@dataclass
class TunnelInfo:
    job_id: str
    cluster: str
    url: str                # on this machine
    local_port: int
    remote: str             # node:port on the cluster
    api_key_file: str       # a local 0600 copy ("" when the server has no key)
    pid: int = 0
    model: str = ""         # the served model name (the id given to `serve`)
    models: list[dict] = field(default_factory=list)   # every engine: model, url, local_port, remote, adapters

    def to_dict(self) -> dict:
        return asdict(self)


def state_dir() -> Path:
    from platformdirs import user_state_dir

    return Path(os.environ.get("TGI_HPC_STATE_DIR") or user_state_dir("tgi-hpc"))


def _registry() -> Path:
    return state_dir() / "tunnels"


def pick_job(cluster: Cluster, job_id: str | None) -> str:
    """The given job, or my newest serve job that is running."""
    if job_id:
        return job_id
    running = [st for st in jobs.status(cluster, with_probe=False) if st.kind == "serve" and st.state in ("STARTING", "LISTENING", "READY")]
    if not running:
        raise UsageError("no running tgi-hpc serve job: give a job id, or start one with `tgi-hpc serve`")
    return max(running, key=lambda st: int(st.job_id.split("_")[0])).job_id


def _local_key(cluster: Cluster, job_id: str, remote_key: str | None) -> str:
    if not remote_key:
        return ""
    path = state_dir() / "keys" / f"{cluster.profile.cluster or cluster.profile.name}-{job_id}.key"
    write_atomic(path, remote_key + "\n", mode=0o600)
    return str(path)


def _connector(cluster: Cluster, accept_host_key: bool):
    runner = cluster.runner
    if not isinstance(runner, LocalRunner):
        return runner.transport  # the same connection the Slurm commands use
    from tgi_hpc.remote.ssh import connect

    if not cluster.profile.login_host:
        raise TunnelError(f"profile {cluster.profile.name} has no login_host to tunnel through")
    return lambda: connect(cluster.profile.login_host, accept_new_host_key=accept_host_key)


class Tunnels:
    """The tunnels of a job that serves several models (one local port each), closed together."""

    def __init__(self, tunnels: list) -> None:
        self.tunnels = tunnels

    def close(self) -> None:
        for tunnel in self.tunnels:
            tunnel.close()


def _more_tunnels(cluster: Cluster, job_id: str, endpoint, first, local_port: int | None, shared: bool,
                  accept_host_key: bool) -> list:
    """One more tunnel per further engine: local port = its remote port when free (or --local-port + i)."""
    from tgi_hpc.remote.tunnel import Tunnel, wait_http_ready

    opened = [first]
    try:
        for i, engine in enumerate(endpoint.engines[1:], start=1):
            def target(i=i) -> tuple[str, int]:
                current = jobs.read_endpoint(cluster, job_id) or endpoint
                engines = current.engines
                return current.host, (engines[i] if i < len(engines) else engine).port

            port = local_port + i if local_port else (engine.port if is_port_free(engine.port, "127.0.0.1") else 0)
            tunnel = Tunnel(_connector(cluster, accept_host_key), endpoint.host, target, local_port=port,
                            close_connection=not shared).start()
            opened.append(tunnel)
            wait_http_ready(tunnel.url, timeout=60)
    except BaseException:
        Tunnels(opened).close()
        raise
    return opened


def open_tunnel(cluster: Cluster, job_id: str, *, local_port: int | None = None, accept_host_key: bool = False,
                timeout: float = 600, progress=lambda message: None):
    """Wait for the job to be READY, forward a local port to it, check /health through it."""
    from tgi_hpc.remote.tunnel import Tunnel, wait_http_ready

    st = jobs.wait(cluster, job_id, until={"READY"}, timeout=timeout, on_change=lambda s: progress(s.describe()),
                   on_beat=jobs.heartbeat(progress))
    endpoint = jobs.read_endpoint(cluster, job_id)

    def target() -> tuple[str, int]:
        current = jobs.read_endpoint(cluster, job_id) or endpoint
        return current.host, current.port

    port = local_port if local_port is not None else (endpoint.port if is_port_free(endpoint.port, "127.0.0.1") else 0)
    shared = not isinstance(cluster.runner, LocalRunner)  # the runner's connection outlives the tunnel
    tunnel = Tunnel(_connector(cluster, accept_host_key), endpoint.host, target, local_port=port,
                    close_connection=not shared).start()
    try:
        wait_http_ready(tunnel.url, timeout=60)
    except BaseException:
        tunnel.close()
        raise
    info = TunnelInfo(job_id, cluster.profile.cluster or cluster.profile.name, tunnel.url, tunnel.local_port,
                      f"{st.node or endpoint.host}:{endpoint.port}",
                      _local_key(cluster, job_id, jobs.read_api_key(cluster, endpoint)), os.getpid(), endpoint.model)
    if len(endpoint.engines) == 1 and not endpoint.adapters:
        return tunnel, info
    opened = _more_tunnels(cluster, job_id, endpoint, tunnel, local_port, shared, accept_host_key)
    info.models = [{"model": e.model, "url": t.url, "local_port": t.local_port, "adapters": list(e.adapters),
                    "remote": f"{st.node or endpoint.host}:{e.port}"} for e, t in zip(endpoint.engines, opened)]
    return (Tunnels(opened) if len(opened) > 1 else tunnel), info


def instructions(info: TunnelInfo) -> str:
    """What to paste: quoted for the shell and for Python (state dirs can hold spaces or backslashes)."""
    key_file = info.api_key_file
    auth = f' -H "Authorization: Bearer $(cat {shlex.quote(key_file)})"' if key_file else ""
    key = f"open({key_file!r}).read().strip()" if key_file else '"-"'
    served = [f"{m['model']} at {m['url']}  (-> {m['remote']})"
              + (f"; adapters (model= or adapter_id): {', '.join(m['adapters'])}" if m["adapters"] else "")
              for m in info.models]
    return "\n".join([*served, *([""] if served else []),
        f"ready at {info.url}  (job {info.job_id} on {info.remote})",
        f"api key: {info.api_key_file or '(none: server started with --no-api-key)'}",
        f"curl {info.url}/generate{auth} -H 'Content-Type: application/json' \\",
        "     -d '{\"inputs\": \"Hello\", \"parameters\": {\"max_new_tokens\": 20}}'",
        "python:",
        "  from openai import OpenAI",
        f'  client = OpenAI(base_url="{info.url}/v1", api_key={key})',
        f'  client.chat.completions.create(model={(info.model or "tgi")!r}, '
        'messages=[{"role": "user", "content": "Hello"}])',
    ])


def register(info: TunnelInfo) -> None:
    write_atomic(_registry() / f"{info.job_id}.json", json.dumps(info.to_dict()) + "\n", mode=0o600)


def unregister(job_id: str) -> None:
    (_registry() / f"{job_id}.json").unlink(missing_ok=True)


def list_tunnels() -> list[TunnelInfo]:
    found = []
    for path in sorted(_registry().glob("*.json")) if _registry().is_dir() else []:
        info = TunnelInfo(**json.loads(path.read_text()))
        if pid_alive(info.pid):
            found.append(info)
        else:
            path.unlink(missing_ok=True)  # a tunnel that died without cleaning up
    return found


def stop_tunnels(job_ids: list[str] | None) -> list[str]:
    stopped = []
    for info in list_tunnels():
        if job_ids is None or info.job_id in job_ids:
            os.kill(info.pid, signal.SIGTERM)
            unregister(info.job_id)
            stopped.append(info.job_id)
    return stopped


def start_background(argv: list[str], job_id: str, timeout: float = 600) -> TunnelInfo:
    """Run `tgi-hpc tunnel open JOB --foreground-child` detached; return once it is registered."""
    unregister(job_id)
    log = _registry() / f"{job_id}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as err:  # the child outlives us: its messages go to a file, not our pipe
        proc = subprocess.Popen([sys.executable, "-m", "tgi_hpc", *argv], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for info in list_tunnels():
            if info.job_id == job_id and info.pid == proc.pid:
                return info
        if proc.poll() is not None:
            raise TunnelError(f"the background tunnel exited: {log.read_text().strip()[-500:]}")
        time.sleep(0.2)
    proc.terminate()
    raise TunnelError(f"the background tunnel to job {job_id} was not ready within {timeout:.0f} s")
