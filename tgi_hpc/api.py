"""Drive serve jobs from Python, with the same workflows as the `tgi-hpc` command (and, like it, without torch).

    from tgi_hpc import api

    server = api.serve("HuggingFaceTB/SmolLM2-135M-Instruct", cluster="mila")   # submitted: server.job_id
    server.wait_until_ready(timeout=1800)
    with server.endpoint() as ep:            # on the cluster: node:port; on a laptop: a tunnel, closed on exit
        httpx.post(f"{ep.url}/generate", headers=ep.headers, json={"inputs": "Hello"})
    print(server.metrics())                  # tokens/s, queue, KV usage, latency (one sample)
    server.stop()

Every function also takes a job id or a service name (`api.endpoint("4148", cluster="mila")`), e.g. in a job
chained with `sbatch --dependency=after:4148` (docs/examples/). Errors are `tgi_hpc.errors.TgiHpcError` subclasses.
`cluster` defaults to $TGI_HPC_CLUSTER, else the cluster detected here, and `overrides` to $TGI_HPC_SET (as for
the command). Pass a `Server` (from `serve` or `attach`) around to reuse one SSH connection from a laptop.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from tgi_hpc.errors import UsageError
from tgi_hpc.service.state import check_name, is_job_id
from tgi_hpc.slurm import jobs
from tgi_hpc.slurm.cluster import Cluster, open_cluster
from tgi_hpc.slurm.jobs import JobStatus
from tgi_hpc.workflows import access, scrape
from tgi_hpc.workflows.access import Access
from tgi_hpc.workflows.serve import LIMIT_FLAGS, ServeOptions, gpu_type_from_overrides, run_serve
from tgi_hpc.workflows.service import ServiceOptions, run_service, stop_service

logger = logging.getLogger(__name__)

__all__ = ["Access", "Batch", "Server", "attach", "batch", "endpoint", "metrics", "serve", "status", "stop", "wait_until_ready"]


def _open(cluster: str | Cluster | None, overrides: Sequence[str], remote: bool | None) -> Cluster:
    """The cluster to act on; the command's environment twins (TGI_HPC_CLUSTER, TGI_HPC_SET) fill what is not
    given, so a job chained after a serve job reaches the same cluster with the environment sbatch passed on."""
    if isinstance(cluster, Cluster):
        return cluster
    overrides = list(overrides) or os.environ.get("TGI_HPC_SET", "").split()
    return open_cluster(cluster or os.environ.get("TGI_HPC_CLUSTER"), overrides, remote=remote)


@dataclass
class Server:
    """A serve job, or a service (`serve(replicas=..., handover=...)`, `attach("NAME")`): its first job's id, the
    model, the cluster. Methods act on it; `close()` ends the SSH connection to the cluster, if any."""

    job_id: str                    # the job; a service's first job ("" when attached by name)
    model: str
    cluster: Cluster = field(repr=False)
    service: str = ""              # the service's name: endpoint() and metrics() follow its replicas

    @property
    def target(self) -> str:
        return self.service or self.job_id

    @property
    def port(self) -> int | None:
        """The port the job's server listens on, once the job has published it."""
        found = jobs.read_endpoint(self.cluster, self.job_id) if self.job_id else None
        return found.port if found else None

    def status(self) -> JobStatus:
        """The job's state: PENDING / STARTING / READY / ENDING or how it ended (a /health probe once it is up)."""
        return jobs.status(self.cluster, [self._job()])[0]

    def wait_until_ready(self, timeout: float = 1800) -> JobStatus:
        """Block until READY (a real one-token generation went through; a service: one replica READY);
        JobFailedError if the job ends first, ReadinessTimeout after `timeout` seconds (it keeps running)."""
        if self.service:
            from tgi_hpc.workflows.service_tunnel import _wait_serving

            first = _wait_serving(self.cluster, self.service, timeout, logger.info)[0]
            return jobs.status(self.cluster, [first.job_id])[0]
        return jobs.wait(self.cluster, self.job_id, until={"READY"}, timeout=timeout,
                         on_change=lambda st: logger.info("%s", st.describe()), on_beat=jobs.heartbeat(logger.info))

    def endpoint(self, timeout: float = 600, model: str | None = None) -> Access:
        """URL + API key that work from here (waits for READY). Close it (or use `with`) to close a tunnel.
        A service's `urls()` lists its READY replicas on the cluster; from a laptop, its tunnel balances them.
        `model`: in a job serving several models (or adapters), the one to reach (default: the first)."""
        return access.connect(self.cluster, self.target, model=model, timeout=timeout, progress=logger.info)

    def metrics(self, interval: float = 1.0, model: str | None = None) -> dict:
        """One sample of the server's numbers (a service: its replicas added up; a job serving several models:
        all its engines, or `model`'s), as `tgi-hpc metrics --json`."""
        with self.endpoint(model=model) as found:
            fleet = scrape.Fleet(found.replicas, found.headers)
            try:
                summary = scrape.sample(fleet, interval)
            finally:
                fleet.close()
        summary.target, summary.url = found.job_id, found.url
        return summary.to_dict()

    def embed(self, texts: str | list[str], *, dimensions: int | None = None, batch_size: int = 256,
              model: str | None = None, prompt_name: str | None = None,
              input_type: str | None = None) -> list[list[float]]:
        """Embeddings from a pooling model's server (/v1/embeddings), one vector per text in order, sent
        `batch_size` texts per request (a service: spread over its READY replicas). `input_type` "query" or
        "document" (or a `prompt_name`) picks the model's prompt, as ServiceClient.embed says."""
        from tgi_hpc.service.client import ServiceClient

        with self.endpoint(model=model) as found, ServiceClient(urls=found.urls(), api_key=found.api_key) as client:
            return client.embed(texts, dimensions=dimensions, batch_size=batch_size, prompt_name=prompt_name,
                                input_type=input_type)

    def stop(self) -> None:
        """Cancel the job, or every job of the service (none submits a successor any more); a job that had
        already ended is left as it was."""
        if self.service:
            stop_service(self.cluster, self.service)
        else:
            jobs.stop(self.cluster, [self.job_id])

    def close(self) -> None:
        self.cluster.close()

    def _job(self) -> str:
        if not self.job_id:
            raise UsageError(f"{self.service!r} is a service: its jobs change; use endpoint() or metrics(), "
                             f"or `tgi-hpc endpoint {self.service}` for its replicas")
        return self.job_id


def serve(model: str, *, cluster: str | Cluster | None = None, overrides: Sequence[str] = (), remote: bool | None = None,
          revision: str = "main", gpus: int | None = None, gpu_type: str | None = None, time: str | None = None,
          partition: str | None = None,
          env: Mapping[str, str] | None = None, engine_args: Sequence[str] = (), requeue: bool = False,
          replicas: int = 1, service: str | None = None, handover: str | None = None, keep_alive: bool = False,
          api_key: bool = True, shared_weights: bool = True, release: str | None = None, wait: bool = False,
          timeout: float = 1800, lora: Mapping[str, str] | None = None, **limits: object) -> Server:
    """Submit a serve job, as `tgi-hpc serve` does (same options, same checks). `limits`: dtype, quantize and TGI's
    engine limits (max_total_tokens=..., ...); `engine_args`: other engine flags as "FLAG=VALUE". `replicas`,
    `service`, `handover` (a lead: seconds or a Slurm time) or `keep_alive` make it a service; `requeue`, one job
    that requeues itself. `lora`: {NAME: "ORG/ADAPTER" or a folder}, as `--lora NAME=...`."""
    unknown = sorted(set(limits) - set(LIMIT_FLAGS))
    if unknown:
        raise UsageError(f"serve(): unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(LIMIT_FLAGS))}")
    gpu_type = gpu_type if gpu_type is not None else gpu_type_from_overrides(overrides)
    opts = ServeOptions(model=model, revision=revision, gpus=gpus, gpu_type=gpu_type, time=time, partition=partition,
                        limits=dict(limits),
                        env=[f"{k}={v}" for k, v in (env or {}).items()], engine_args=list(engine_args),
                        keep_alive=requeue, api_key=api_key, shared_weights=shared_weights,
                        loras=[f"{name}={source}" for name, source in (lora or {}).items()])
    where = _open(cluster, overrides, remote)
    if replicas > 1 or service or handover or keep_alive:
        if requeue:
            raise UsageError("serve(): requeue is for a single job; a service hands over to a successor instead")
        svc = ServiceOptions(service, replicas, bool(handover or keep_alive), handover)
        started = run_service(where, opts, svc, release=release, wait=wait, timeout=timeout, progress=logger.info)
        return Server(started.job_id or "", model, where, started.name)
    result = run_serve(where, opts, release=release, wait=wait, timeout=timeout, progress=logger.info)
    return Server(result.job_id, model, where)


def attach(target: str | Server, *, cluster: str | Cluster | None = None, overrides: Sequence[str] = (),
           remote: bool | None = None) -> Server:
    """A Server for a job or service started elsewhere (the command, another script, a predecessor job)."""
    if isinstance(target, Server):
        return target
    where = _open(cluster, overrides, remote)
    if is_job_id(target):
        return Server(target, "", where)
    return Server("", "", where, check_name(target))


def status(target: str | Server, **where) -> JobStatus:
    return attach(target, **where).status()


def wait_until_ready(target: str | Server, timeout: float = 1800, **where) -> JobStatus:
    return attach(target, **where).wait_until_ready(timeout)


def endpoint(target: str | Server, timeout: float = 600, model: str | None = None, **where) -> Access:
    return attach(target, **where).endpoint(timeout, model)


def metrics(target: str | Server, interval: float = 1.0, model: str | None = None, **where) -> dict:
    return attach(target, **where).metrics(interval, model)


def embed(target: str | Server, texts: str | list[str], *, dimensions: int | None = None, batch_size: int = 256,
          prompt_name: str | None = None, input_type: str | None = None, **where) -> list[list[float]]:
    return attach(target, **where).embed(texts, dimensions=dimensions, batch_size=batch_size, prompt_name=prompt_name,
                                         input_type=input_type)


def stop(target: str | Server, **where) -> None:
    attach(target, **where).stop()


@dataclass
class Batch:
    """A batch (`batch(...)`): its jobs work through the input; `progress()`, `wait()`, `results()`."""

    output: str
    job_ids: list[str]
    cluster: Cluster = field(repr=False)

    def _ledger(self):
        from pathlib import Path

        from tgi_hpc.batch.ledger import Ledger
        from tgi_hpc.batch.submission import batch_dir_of
        return Ledger(batch_dir_of(Path(self.output)))

    def progress(self) -> dict:
        """{total, done, failed, shards, shards_done, holders, complete} from the batch's ledger."""
        return self._ledger().progress().to_dict()

    def wait(self, timeout: float = 24 * 3600, poll_s: float = 5.0) -> dict:
        """Block until every request is answered and the output is written; JobFailedError if the jobs end
        first (call `batch(...)` again with the same arguments to go on), ReadinessTimeout after `timeout`."""
        from tgi_hpc.batch.submission import follow

        return follow(self.cluster, self._ledger(), self.job_ids, timeout=timeout, progress=logger.info,
                      poll_s=poll_s)

    def results(self):
        """The output's lines as dicts, in input order (once complete)."""
        import json

        with open(self.output) as fh:
            for line in fh:
                yield json.loads(line)


def batch(model: str, input: str, output: str, *, jobs: int = 1, cluster: str | Cluster | None = None,
          overrides: Sequence[str] = (), release: str | None = None, restart: bool = False,
          gpus: int | None = None, time: str | None = None, **limits) -> Batch:
    """Submit (or continue) `tgi-hpc batch`: the jobs answer every line of `input` into `output`."""
    from tgi_hpc.batch.submission import BatchOptions, run_batch

    unknown = set(limits) - set(LIMIT_FLAGS)
    if unknown:
        raise UsageError(f"unknown engine limit(s): {', '.join(sorted(unknown))}")
    where = _open(cluster, overrides, None)
    opts = BatchOptions(ServeOptions(model=model, gpus=gpus, time=time, limits=limits), input, output, jobs=jobs,
                        restart=restart)
    result = run_batch(where, opts, release=release, progress=logger.info)
    return Batch(result.output, result.submitted + result.running, where)
