"""`tgi-hpc tunnel [JOB]`, `tunnel list`, `tunnel stop`, and `tgi-hpc ssh-config CLUSTER`."""
from __future__ import annotations

from collections.abc import Callable

import click

from tgi_hpc.cli._app import App, OpenByDefault, with_app


@click.group(cls=OpenByDefault)
def tunnel() -> None:
    """Forward a port on this machine to a serve job (through the login node), or manage background tunnels.

    `open` is the default: `tgi-hpc tunnel 4148` = `tgi-hpc tunnel open 4148`, and a bare
    `tgi-hpc tunnel` opens one to my newest running serve job.
    """


def hold(app: App, tunnel_obj, info, cluster, stop_job: bool) -> None:
    """Keep a foreground tunnel open until Ctrl-C; then say how to come back (or stop the job)."""
    import time

    from tgi_hpc.slurm import jobs

    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        tunnel_obj.close()
    from tgi_hpc.service.state import is_job_id

    if stop_job and not is_job_id(info.job_id):   # a service
        from tgi_hpc.workflows.service import stop_service

        stop_service(cluster, info.job_id)
        app.info(f"tunnel closed; service {info.job_id} stopped")
    elif stop_job:
        jobs.stop(cluster, [info.job_id])
        app.info(f"tunnel closed; job {info.job_id} stopped")
    else:
        again = app.again()
        app.info(f"tunnel closed; job {info.job_id} keeps running. Reconnect: tgi-hpc tunnel {info.job_id}{again}"
                 f"   Stop it: tgi-hpc stop {info.job_id}{again}")


@tunnel.command("open")
@click.argument("job_id", metavar="[JOB|SERVICE]", required=False)
@click.option("--local-port", type=click.IntRange(0, 65535), help="Port on this machine (default: the job's port, if free).")
@click.option("--background", is_flag=True, help="Detach; manage it with `tunnel list` / `tunnel stop`.")
@click.option("--timeout", default=600.0, show_default=True, help="Seconds to wait for the job to be READY.")
@click.option("--foreground-child", is_flag=True, hidden=True)
@with_app
def open_command(app: App, job_id, local_port, background, timeout, foreground_child) -> None:
    """Forward 127.0.0.1:PORT here to JOB's server (default: my newest running serve job), or to SERVICE's
    READY replicas: each new connection to the least busy one, following handovers and failing over.

    --background needs a login without prompts (a key in ssh-agent): a detached process cannot answer 2FA.
    """
    from tgi_hpc.workflows import tunnel_session as ts

    cluster = app.cluster()
    accept_host_key = app.accept_host_key
    job_id = ts.pick_job(cluster, job_id)
    if background and getattr(cluster.runner, "prompted", False):   # a detached child would be asked too
        from tgi_hpc.errors import UsageError
        from tgi_hpc.remote.ssh import no_terminal_message

        raise UsageError("--background: " + no_terminal_message(cluster.runner.alias))
    if background:
        argv = ["tunnel", "open", job_id, "--foreground-child", "--timeout", str(timeout)]
        argv += ["--cluster", app.cluster_name] if app.cluster_name else []
        argv += [f"--set={item}" for item in app.overrides]
        argv += ["--local-port", str(local_port)] if local_port is not None else []
        argv += ["--accept-host-key"] if accept_host_key else []
        info = ts.start_background(argv, job_id, timeout=timeout + 60)
        app.emit(info.to_dict(), ts.instructions(info))
        return
    from tgi_hpc.service.state import is_job_id

    if is_job_id(job_id):
        tunnel_obj, info = ts.open_tunnel(cluster, job_id, local_port=local_port, accept_host_key=accept_host_key,
                                          timeout=timeout, progress=app.info)
    else:   # a service: balanced over its replicas, following its handovers
        from tgi_hpc.workflows.service_tunnel import open_service_tunnel

        tunnel_obj, info = open_service_tunnel(cluster, job_id, local_port=local_port, accept_host_key=accept_host_key,
                                               timeout=timeout, progress=app.info)
    if foreground_child:
        ts.register(info)
    app.emit(info.to_dict(), ts.instructions(info))
    try:
        hold(app, tunnel_obj, info, cluster, stop_job=False)
    finally:
        if foreground_child:
            ts.unregister(info.job_id)


@tunnel.command("list")
@with_app
def list_command(app: App) -> None:
    """Background tunnels still running."""
    from tgi_hpc.workflows.tunnel_session import list_tunnels

    infos = list_tunnels()
    app.emit([i.to_dict() for i in infos],
             "\n".join(f"{i.job_id}  {i.url}  -> {i.remote}  ({i.cluster}, pid {i.pid})"
                       + "".join(f"\n      {m['model']}  {m['url']}  -> {m['remote']}" for m in i.models[1:])
                       for i in infos) or "no tunnels")


@tunnel.command("stop")
@click.argument("job_ids", nargs=-1)
@with_app
def stop_command(app: App, job_ids) -> None:
    """Stop background tunnels (all of them without JOB_IDS)."""
    from tgi_hpc.workflows.tunnel_session import stop_tunnels

    stopped = stop_tunnels(list(job_ids) or None)
    app.emit({"stopped": stopped}, f"stopped tunnels: {' '.join(stopped)}" if stopped else "no tunnel stopped")


@click.command("ssh-config")
@click.argument("cluster_name", metavar="CLUSTER")
@click.option("--user", "-u", required=True, help="Your username on the cluster.")
@click.option("--append", is_flag=True, help="Append to ~/.ssh/config after asking.")
def ssh_config(cluster_name, user, append) -> None:
    """Print the ~/.ssh/config entries CLUSTER needs (ControlMaster for ssh/scp/rsync, compute-node hops).

    CLUSTER is a cluster (mila, fir, nibi, rorqual, narval, trillium, tamia, killarney, vulcan) or a
    profile (name or YAML path) with an `ssh:` section.
    """
    from pathlib import Path

    from tgi_hpc.remote.ssh_config import CLUSTERS, profile_ssh, render_ssh_config

    spec, name = None, cluster_name
    if cluster_name not in CLUSTERS:
        from tgi_hpc.profiles.loader import load_profile

        profile = load_profile(cluster_name)
        name = profile.cluster or profile.name
        spec = None if name in CLUSTERS else profile_ssh(profile)
        if spec is None and name not in CLUSTERS:
            from tgi_hpc.errors import UsageError

            raise UsageError(f"profile {profile.name!r} is not a known cluster and has no `ssh:` section "
                             f"(login options and node patterns); known clusters: {', '.join(CLUSTERS)}")
    text = render_ssh_config(name, user, spec)
    if not append:
        click.echo(text, nl=False)
        return
    path = Path.home() / ".ssh" / "config"
    click.echo(text, nl=False)
    if click.confirm(f"Append these entries to {path}?", err=True):
        path.parent.mkdir(mode=0o700, exist_ok=True)
        with path.open("a") as fh:
            fh.write("\n" + text)
        click.echo(f"appended to {path}", err=True)


def deliver(app: App, cluster, result, *, dry_run: bool, open_tunnel: bool, stop_on_exit: bool,
            tunnel: Callable[[], tuple], stop: Callable[[], object]) -> None:
    """Print what serve did (the script of a dry run, or the submitted job or service); with --tunnel, open
    the tunnel and hold it until Ctrl-C."""
    if dry_run:
        app.emit({"script": result.script}, lambda: click.echo(result.script, nl=False))
        return
    if not open_tunnel:
        app.emit(result.to_dict(), result.summary())
        return
    from tgi_hpc.workflows.tunnel_session import instructions

    try:
        tunnel_obj, info = tunnel()
    except BaseException:
        if stop_on_exit:  # Ctrl-C or a failure before the tunnel opened: still honour --stop-on-exit
            stop()
        raise
    app.emit({**result.to_dict(), "tunnel": info.to_dict()}, instructions(info))
    hold(app, tunnel_obj, info, cluster, stop_job=stop_on_exit)
