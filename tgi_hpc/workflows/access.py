"""Reaching a READY serve job's HTTP API from here: its own address on the cluster (a login node or another
job), else this laptop's background tunnel to it, else a tunnel opened for as long as the caller needs it.

`metrics`, `chat` and `tgi_hpc.api.endpoint` all go through `connect`, so they reach a job the same way.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

from tgi_hpc.errors import UsageError
from tgi_hpc.slurm import jobs
from tgi_hpc.slurm.cluster import Cluster
from tgi_hpc.workflows import tunnel_session

logger = logging.getLogger(__name__)

_JOB_ID = re.compile(r"^[0-9]+(_[0-9]+)?$")


@dataclass
class Access:
    """An open way to a job's server: `url` answers here; `api_key` is None when it runs without one."""

    job_id: str
    url: str
    api_key: str | None
    model: str = ""
    via: str = "direct"            # "direct" (node:port), "tunnel" (opened here), "background tunnel"
    _tunnel: object | None = field(default=None, repr=False)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def to_dict(self) -> dict:
        return {"job_id": self.job_id, "url": self.url, "api_key": self.api_key, "model": self.model, "via": self.via}

    def close(self) -> None:
        """Close the tunnel this access opened (a direct address or a background tunnel stays as it was)."""
        if self._tunnel is not None:
            self._tunnel.close()
            self._tunnel = None

    def __enter__(self) -> Access:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def resolve_job(cluster: Cluster, target: str | None) -> str:
    """A job id as given, or my newest running serve job when none is given."""
    if target is None:
        return tunnel_session.pick_job(cluster, None)
    if not _JOB_ID.match(target):
        raise UsageError(f"{target!r} is not a job id (digits, or ARRAY_TASK like 4148_2)")
    return target


def connect(cluster: Cluster, target: str | None = None, *, timeout: float = 600,
            progress=lambda message: None) -> Access:
    """Wait for the job to be READY, then the shortest way to it from here (see the module docstring)."""
    job_id = resolve_job(cluster, target)
    st = jobs.wait(cluster, job_id, until={"READY"}, timeout=timeout, on_change=lambda s: progress(s.describe()),
                   on_beat=jobs.heartbeat(progress))
    endpoint = jobs.read_endpoint(cluster, job_id)
    if cluster.is_local and endpoint is not None:
        return Access(job_id, endpoint.url, jobs.read_api_key(cluster, endpoint), endpoint.model, "direct")
    for info in tunnel_session.list_tunnels():
        if info.job_id == job_id and info.cluster == (cluster.profile.cluster or cluster.profile.name):
            key = Path(info.api_key_file).read_text().strip() if info.api_key_file else None
            logger.info("job %s: using the background tunnel at %s", job_id, info.url)
            return Access(job_id, info.url, key, info.model, "background tunnel")
    tunnel, info = tunnel_session.open_tunnel(cluster, job_id, local_port=0, timeout=timeout, progress=progress)
    key = Path(info.api_key_file).read_text().strip() if info.api_key_file else None
    logger.info("job %s (%s): tunnel at %s", job_id, st.node, info.url)
    return Access(job_id, info.url, key, info.model, "tunnel", tunnel)
