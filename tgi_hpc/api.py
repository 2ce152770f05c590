"""Drive serve jobs from Python, with the same workflows as the `tgi-hpc` command (and, like it, without torch).

    from tgi_hpc import api

    server = api.serve("HuggingFaceTB/SmolLM2-135M-Instruct", cluster="mila")   # submitted: server.job_id
    server.wait_until_ready(timeout=1800)
    with server.endpoint() as ep:            # on the cluster: node:port; on a laptop: a tunnel, closed on exit
        httpx.post(f"{ep.url}/generate", headers=ep.headers, json={"inputs": "Hello"})
    print(server.metrics())                  # tokens/s, queue, KV usage, latency (one sample)
    server.stop()

Every function also takes a job id (`api.endpoint("4148", cluster="mila")`), e.g. in a job chained with
`sbatch --dependency=after:4148` (docs/examples/). Errors are `tgi_hpc.errors.TgiHpcError` subclasses.
`cluster` defaults to $TGI_HPC_CLUSTER, else the cluster detected here, and `overrides` to $TGI_HPC_SET (as for
the command). Pass a `Server` (from `serve` or `attach`) around to reuse one SSH connection from a laptop.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from tgi_hpc.errors import UsageError
from tgi_hpc.slurm import jobs
from tgi_hpc.slurm.cluster import Cluster, open_cluster
from tgi_hpc.slurm.jobs import JobStatus
from tgi_hpc.workflows import access, metrics as metrics_flow
from tgi_hpc.workflows.access import Access
from tgi_hpc.workflows.serve import LIMIT_FLAGS, ServeOptions, run_serve

logger = logging.getLogger(__name__)

__all__ = ["Access", "Server", "attach", "endpoint", "metrics", "serve", "status", "stop", "wait_until_ready"]


def _open(cluster: str | Cluster | None, overrides: Sequence[str], remote: bool | None) -> Cluster:
    """The cluster to act on; the command's environment twins (TGI_HPC_CLUSTER, TGI_HPC_SET) fill what is not
    given, so a job chained after a serve job reaches the same cluster with the environment sbatch passed on."""
    if isinstance(cluster, Cluster):
        return cluster
    overrides = list(overrides) or os.environ.get("TGI_HPC_SET", "").split()
    return open_cluster(cluster or os.environ.get("TGI_HPC_CLUSTER"), overrides, remote=remote)


@dataclass
class Server:
    """A serve job: its id, model and cluster. Methods act on the job; `close()` ends an SSH connection."""

    job_id: str
    model: str
    cluster: Cluster = field(repr=False)

    @property
    def port(self) -> int | None:
        """The port the server listens on, once the job has published it."""
        found = jobs.read_endpoint(self.cluster, self.job_id)
        return found.port if found else None

    def status(self) -> JobStatus:
        """PENDING / STARTING / READY / ENDING or how it ended (a /health probe once the server is up)."""
        return jobs.status(self.cluster, [self.job_id])[0]

    def wait_until_ready(self, timeout: float = 1800) -> JobStatus:
        """Block until READY (a real one-token generation went through); JobFailedError if the job ends first,
        ReadinessTimeout after `timeout` seconds (the job keeps running)."""
        return jobs.wait(self.cluster, self.job_id, until={"READY"}, timeout=timeout,
                         on_change=lambda st: logger.info("%s", st.describe()),
                         on_beat=jobs.heartbeat(logger.info))

    def endpoint(self, timeout: float = 600) -> Access:
        """URL + API key that work from here (waits for READY). Close it (or use `with`) to close a tunnel."""
        return access.connect(self.cluster, self.job_id, timeout=timeout, progress=logger.info)

    def metrics(self, interval: float = 1.0) -> dict:
        """One sample of the server's numbers: two /metrics scrapes `interval` s apart (see `tgi-hpc metrics`)."""
        with self.endpoint() as found:
            scraper = metrics_flow.Scraper(found.url, found.headers)
            try:
                summary = metrics_flow.sample(scraper, interval)
            finally:
                scraper.close()
        summary.job_id, summary.url = found.job_id, found.url
        return summary.to_dict()

    def stop(self) -> None:
        """Cancel the job (a job that had already ended is left as it was)."""
        jobs.stop(self.cluster, [self.job_id])

    def close(self) -> None:
        self.cluster.close()


def serve(model: str, *, cluster: str | Cluster | None = None, overrides: Sequence[str] = (), remote: bool | None = None,
          revision: str = "main", gpus: int | None = None, time: str | None = None, partition: str | None = None,
          env: Mapping[str, str] | None = None, engine_args: Sequence[str] = (), keep_alive: bool = False,
          api_key: bool = True, shared_weights: bool = True, release: str | None = None, wait: bool = False,
          timeout: float = 1800, **limits: object) -> Server:
    """Submit a serve job, as `tgi-hpc serve` does. `limits`: dtype, quantize and TGI's engine limits
    (max_total_tokens=..., max_concurrent_requests=...); `engine_args`: other engine flags as "FLAG=VALUE"."""
    unknown = sorted(set(limits) - set(LIMIT_FLAGS))
    if unknown:
        raise UsageError(f"serve(): unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(LIMIT_FLAGS))}")
    opts = ServeOptions(model=model, revision=revision, gpus=gpus, time=time, partition=partition, limits=dict(limits),
                        env=[f"{k}={v}" for k, v in (env or {}).items()], engine_args=list(engine_args),
                        keep_alive=keep_alive, api_key=api_key, shared_weights=shared_weights)
    where = _open(cluster, overrides, remote)
    result = run_serve(where, opts, release=release, wait=wait, timeout=timeout, progress=logger.info)
    return Server(result.job_id, model, where)


def attach(job: str | Server, *, cluster: str | Cluster | None = None, overrides: Sequence[str] = (),
           remote: bool | None = None) -> Server:
    """A Server for a job submitted elsewhere (by the command, another script, a predecessor job)."""
    if isinstance(job, Server):
        return job
    where = _open(cluster, overrides, remote)
    return Server(access.resolve_job(where, job), "", where)


def status(job: str | Server, **where) -> JobStatus:
    return attach(job, **where).status()


def wait_until_ready(job: str | Server, timeout: float = 1800, **where) -> JobStatus:
    return attach(job, **where).wait_until_ready(timeout)


def endpoint(job: str | Server, timeout: float = 600, **where) -> Access:
    return attach(job, **where).endpoint(timeout)


def metrics(job: str | Server, interval: float = 1.0, **where) -> dict:
    return attach(job, **where).metrics(interval)


def stop(job: str | Server, **where) -> None:
    attach(job, **where).stop()
