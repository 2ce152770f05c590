"""`tgi-hpc endpoint SERVICE`, and the service side of `serve`, `tunnel` and `stop`."""
from __future__ import annotations

import click

from tgi_hpc.cli._app import App, with_app


def serve_service(app: App, cluster, opts, svc, *, release, dry_run, wait, timeout, open_tunnel, local_port,
                  stop_on_exit) -> None:
    from tgi_hpc.workflows.service import run_service, stop_service

    result = run_service(cluster, opts, svc, release=release, dry_run=dry_run, wait=wait and not open_tunnel,
                         timeout=timeout, progress=app.info, again=app.again())
    if dry_run:
        app.emit({"script": result.script}, lambda: click.echo(result.script, nl=False))
        return
    if not open_tunnel:
        app.emit(result.to_dict(), result.summary())
        return
    from tgi_hpc.cli.tunnel import hold
    from tgi_hpc.workflows.tunnel_session import instructions
    from tgi_hpc.workflows.service_tunnel import open_service_tunnel

    try:
        tunnel_obj, info = open_service_tunnel(cluster, result.name, local_port=local_port, timeout=timeout,
                                               progress=app.info)
    except BaseException:
        if stop_on_exit:
            stop_service(cluster, result.name)
        raise
    app.emit({**result.to_dict(), "tunnel": info.to_dict()}, instructions(info))
    hold(app, tunnel_obj, info, cluster, stop_job=stop_on_exit)


@click.command()
@click.argument("service")
@click.option("--no-check", is_flag=True, help="Trust the state file; do not ask Slurm which replicas still run.")
@with_app
def endpoint(app: App, service, no_check) -> None:
    """Print SERVICE's current URLs and API key as shell exports (eval them), or --json.

    \b
    For clients in other jobs on the cluster:  eval "$(tgi-hpc endpoint NAME)"
    then TGI_HPC_URLS (every serving replica), TGI_HPC_URL, TGI_HPC_API_KEY, OPENAI_BASE_URL/OPENAI_API_KEY,
    and TGI_HPC_SERVICE_STATE for tgi_hpc.client.ServiceClient, which follows successors and retries.
    """
    from tgi_hpc.workflows.service import service_endpoint

    found = service_endpoint(app.cluster(), service, check_slurm=not no_check)
    if not found.urls:
        app.info(f"service {service}: no replica is READY now (jobs: "
                 + (" ".join(f"{j['job_id']}={j['state']}" for j in found.jobs) or "none") + ")")
    app.emit(found.to_dict(), found.exports())
