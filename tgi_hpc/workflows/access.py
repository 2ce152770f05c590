"""Reaching a READY serve job, or a service's replicas, from here: their own addresses on the cluster (a login
node or another job), else this laptop's background tunnel, else a tunnel opened for as long as the caller needs.

`metrics`, `chat` and `tgi_hpc.api.endpoint` all go through `connect`, so they reach a target the same way.
A service's replicas change with each handover: `urls()` and `replicas()` read its state file again.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from tgi_hpc.errors import SlurmError, UsageError
from tgi_hpc.remote.runner import LocalRunner
from tgi_hpc.service.state import check_name, is_job_id
from tgi_hpc.slurm import jobs
from tgi_hpc.slurm.cluster import Cluster
from tgi_hpc.workflows import tunnel_session
from tgi_hpc.workflows.service import read_service, service_endpoint

logger = logging.getLogger(__name__)


@dataclass
class Access:
    """An open way to a job's server or a service: `url` answers here; `api_key` is None without a key."""

    job_id: str                    # the job id, or the service's name
    url: str
    api_key: str | None
    model: str = ""
    via: str = "direct"            # "direct" (node:port), "tunnel" (opened here), "background tunnel"
    service: bool = False
    engines: dict[str, str] = field(default_factory=dict)      # a job serving several models: model -> URL here
    _cluster: Cluster | None = field(default=None, repr=False)
    _tunnels: dict = field(default_factory=dict, repr=False)    # what this access opened: key -> tunnel
    _models: list[dict] = field(default_factory=list, repr=False)   # a tunnel's per-engine records (TunnelInfo.models)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def to_dict(self) -> dict:
        return {"job_id": self.job_id, "url": self.url, "api_key": self.api_key, "model": self.model, "via": self.via,
                "service": self.service, "engines": self.engines}

    def urls(self) -> list[str]:
        """Where a request may go now: a service's READY replicas on the cluster; else the one URL (a job, or
        the laptop's balanced tunnel, which follows the service itself)."""
        if not (self.service and self.via == "direct"):
            return [self.url]
        return [j.url for j in read_service(self._cluster, self.job_id).serving()] or [self.url]

    def replicas(self) -> dict[str, str]:
        """Job id -> a URL here for each server behind the target (a service: each READY replica, through a tunnel
        of its own from a laptop), for reads that must reach every one (metrics)."""
        if not self.service:
            if len(self.engines) > 1:     # several models in the job: each engine has its own /metrics
                return {f"{self.job_id}/{model}": url for model, url in self.engines.items()}
            return {self.job_id: self.url}
        serving = {j.job_id: j.url for j in read_service(self._cluster, self.job_id).serving()}
        if self.via == "direct":
            return serving
        for gone in [key for key in self._tunnels if key != "" and key not in serving]:
            self._tunnels.pop(gone).close()
        for job_id, url in serving.items():
            if job_id not in self._tunnels:
                self._tunnels[job_id] = _plain_tunnel(self._cluster, url)
        return {job_id: self._tunnels[job_id].url for job_id in serving}

    def close(self) -> None:
        """Close the tunnels this access opened (a direct address or a background tunnel stays as it was)."""
        for tunnel in self._tunnels.values():
            tunnel.close()
        self._tunnels.clear()

    def __enter__(self) -> Access:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _plain_tunnel(cluster: Cluster, url: str):
    from tgi_hpc.remote.tunnel import Tunnel

    parts = urlsplit(url)
    shared = not isinstance(cluster.runner, LocalRunner)
    return Tunnel(tunnel_session._connector(cluster, False), parts.hostname, parts.port, local_port=0,
                  close_connection=not shared).start()


def resolve_job(cluster: Cluster, target: str | None) -> str:
    """A job id as given, or my newest running serve job when none is given."""
    if target is None:
        return tunnel_session.pick_job(cluster, None)
    if not is_job_id(target):
        raise UsageError(f"{target!r} is not a job id (digits, or ARRAY_TASK like 4148_2)")
    return target


def connect(cluster: Cluster, target: str | None = None, *, model: str | None = None, timeout: float = 600,
            progress=lambda message: None) -> Access:
    """Wait until the target answers, then the shortest way to it from here (see the module docstring).
    `target`: a job id, a service name, or None (my newest running serve job). `model`: in a job serving several
    models (or adapters), the one to talk to (default: the first); the access then covers that engine only."""
    if target is not None and not is_job_id(target):
        return _connect_service(cluster, check_name(target), timeout, progress)
    job_id = resolve_job(cluster, target)
    if jobs.status(cluster, [job_id], with_probe=False)[0].state == "UNKNOWN":
        raise SlurmError(f"no such job: {job_id} (Slurm does not know it)")
    jobs.wait(cluster, job_id, until={"READY"}, timeout=timeout, on_change=lambda s: progress(s.describe()),
              on_beat=jobs.heartbeat(progress))
    endpoint = jobs.read_endpoint(cluster, job_id)
    if cluster.is_local and endpoint is not None:
        engines = {e.model: endpoint.url_of(e) for e in endpoint.engines}
        adapters = {name: endpoint.url_of(e) for e in endpoint.engines for name in e.adapters}
        found = Access(job_id, endpoint.url, jobs.read_api_key(cluster, endpoint), endpoint.model, "direct",
                       engines=engines, _cluster=cluster)
        return _choose(found, model, adapters)
    found = _background(cluster, job_id)
    if found is None:
        tunnel, info = tunnel_session.open_tunnel(cluster, job_id, local_port=0, timeout=timeout, progress=progress)
        found = _from_tunnel(cluster, job_id, info, "tunnel", tunnel)
    adapters = {name: m["url"] for m in found._models for name in m.get("adapters", ())}
    return _choose(found, model, adapters)


def _choose(found: Access, model: str | None, adapters: dict[str, str]) -> Access:
    """Narrow a job's access to one of its models (or an adapter: its engine, requests name the adapter)."""
    if model is None or (model == found.model and len(found.engines) <= 1):
        return found
    if model in found.engines or model in adapters:
        found.url = found.engines.get(model) or adapters[model]
        found.model, found.engines = model, {model: found.url}
        return found
    names = sorted({*found.engines, *adapters} or {found.model})
    found.close()
    raise UsageError(f"job {found.job_id} does not serve {model!r}; it serves: {', '.join(names)}")


def _from_tunnel(cluster: Cluster, name: str, info, via: str, tunnel=None) -> Access:
    engines = {m["model"]: m["url"] for m in info.models}
    return Access(name, info.url, _read_key(info.api_key_file), info.model, via, not is_job_id(name), engines,
                  _cluster=cluster, _tunnels={"": tunnel} if tunnel is not None else {}, _models=list(info.models))


def _connect_service(cluster: Cluster, name: str, timeout: float, progress) -> Access:
    from tgi_hpc.workflows.service_tunnel import _wait_serving, open_service_tunnel

    if cluster.is_local:
        _wait_serving(cluster, name, timeout, progress)
        found = service_endpoint(cluster, name)
        model = read_service(cluster, name).model
        return Access(name, (found.urls or [""])[0], found.api_key, model, "direct", True, _cluster=cluster)
    background = _background(cluster, name)
    if background is not None:
        return background
    tunnel, info = open_service_tunnel(cluster, name, local_port=0, timeout=timeout, progress=progress)
    return _from_tunnel(cluster, name, info, "tunnel", tunnel)


def _background(cluster: Cluster, name: str) -> Access | None:
    """This laptop's background tunnel to the job or service, if `tunnel --background` opened one."""
    for info in tunnel_session.list_tunnels():
        if info.job_id == name and info.cluster == (cluster.profile.cluster or cluster.profile.name):
            logger.info("%s: using the background tunnel at %s", name, info.url)
            return _from_tunnel(cluster, name, info, "background tunnel")
    return None


def _read_key(path: str) -> str | None:
    return Path(path).read_text().strip() or None if path else None
