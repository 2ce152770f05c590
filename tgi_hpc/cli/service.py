"""`tgi-hpc endpoint JOB|SERVICE`, and the service side of `serve`, `tunnel` and `stop`."""
from __future__ import annotations

import click

from tgi_hpc.cli._app import App, with_app


def serve_service(app: App, cluster, opts, svc, *, release, dry_run, wait, timeout, open_tunnel, local_port,
                  stop_on_exit) -> None:
    from tgi_hpc.cli.tunnel import deliver
    from tgi_hpc.workflows.service import run_service, stop_service
    from tgi_hpc.workflows.service_tunnel import open_service_tunnel

    result = run_service(cluster, opts, svc, release=release, dry_run=dry_run, wait=wait and not open_tunnel,
                         timeout=timeout, progress=app.info, again=app.again())

    deliver(app, cluster, result, dry_run=dry_run, open_tunnel=open_tunnel, stop_on_exit=stop_on_exit,
            tunnel=lambda: open_service_tunnel(cluster, result.name, local_port=local_port, timeout=timeout,
                                               accept_host_key=app.accept_host_key,
                                               progress=app.info),
            stop=lambda: stop_service(cluster, result.name))


@click.command()
@click.argument("target", metavar="JOB|SERVICE")
@click.option("--wait", is_flag=True, help="JOB: wait until it is READY (else a job not READY is an error).")
@click.option("--timeout", default=600.0, show_default=True, help="Seconds --wait waits.")
@click.option("--no-check", is_flag=True, help="SERVICE: trust the state file; do not ask Slurm which replicas run.")
@with_app
def endpoint(app: App, target, wait, timeout, no_check) -> None:
    """Print a serve JOB's, or SERVICE's, URLs and API key as shell exports (eval them), or --json.

    \b
    For clients in other jobs on the cluster (an evaluation job):  eval "$(tgi-hpc endpoint 4148 --wait)"
    then TGI_HPC_URL, TGI_HPC_URLS (a service: every serving replica), TGI_HPC_API_KEY, OPENAI_BASE_URL,
    OPENAI_API_KEY; a job adds TGI_HPC_MODEL (the served name), a service TGI_HPC_SERVICE_STATE for
    tgi_hpc.service.client.ServiceClient.from_env(), which follows successors and retries.
    The URLs are the compute nodes' own: from a laptop use `tunnel` instead.
    """
    from tgi_hpc.service.state import is_job_id

    if is_job_id(target):
        from tgi_hpc.workflows.job_endpoint import job_endpoint

        job = job_endpoint(app.cluster(), target, wait=wait, timeout=timeout, progress=app.info)
        app.emit(job.to_dict(), job.exports())
        return
    from tgi_hpc.workflows.service import service_endpoint

    service = target
    found = service_endpoint(app.cluster(), service, check_slurm=not no_check)
    if not found.urls:
        app.info(f"service {service}: no replica is READY now (jobs: "
                 + (" ".join(f"{j['job_id']}={j['state']}" for j in found.jobs) or "none") + ")")
    app.emit(found.to_dict(), found.exports())


def stop_services(app: App, cluster, names: list[str], all_jobs: bool, *, replica: bool = False) -> list[str] | None:
    """`stop` with service names: each service is marked stopped, then its jobs are cancelled; `stop --all`
    marks every service stopped first, so no job submits a successor on its way out. Returns the job ids
    left for `stop` (None when only services were named: their result is printed here)."""
    from tgi_hpc.errors import UsageError
    from tgi_hpc.service.state import is_job_id
    from tgi_hpc.workflows.service import check_replica_stop, stop_all_services, stop_service

    if all_jobs:
        stop_all_services(cluster)
        return None
    services = [n for n in names if not is_job_id(n)]
    if replica and services:
        raise UsageError(f"--replica takes job ids, not a service name ({services[0]})")
    check_replica_stop(cluster, [n for n in names if is_job_id(n)], replica=replica)
    done = {name: stop_service(cluster, name) for name in services}
    if services and len(services) == len(names):
        app.emit({"stopped": [j for ids in done.values() for j in ids], "services": done},
                 "\n".join(f"service {n} stopped" + (f": cancelled {' '.join(ids)}" if ids else "")
                           for n, ids in done.items()))
        return None
    return [n for n in names if is_job_id(n)]
