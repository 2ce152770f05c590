"""`tgi-hpc status`, `logs`, `stop`: watch and manage jobs."""
from __future__ import annotations

import json

import click

from tgi_hpc.cli._app import App, with_app


def _table(rows) -> None:
    from rich.console import Console
    from rich.table import Table

    import sys

    table = Table(box=None, pad_edge=False)
    for column in ("JOB", "KIND", "MODEL", "STATE", "AGE", "REASON", "NODE", "URL"):
        table.add_column(column, no_wrap=column != "REASON")
    for st in rows:
        model = st.model.rstrip("/").rsplit("/", 1)[-1] if st.model.startswith(("/", "~")) else st.model
        others = len(st.models) - 1 + sum(len(m["adapters"]) for m in st.models)   # several models, adapters
        model += f" (+{others})" if others > 0 else ""
        table.add_row(st.job_id, st.kind, model, st.state, st.elapsed, st.reason or st.detail, st.node, st.url)
    # piped into grep or a file: one line per job, never folded to 80 columns
    Console(soft_wrap=True, width=None if sys.stdout.isatty() else 240).print(table)


def _is_path(target: str) -> bool:
    return "/" in target or target.endswith((".jsonl", ".tgi-batch"))


@click.command()
@click.argument("job_ids", nargs=-1)
@click.option("--no-probe", is_flag=True, help="Do not contact running servers (LISTENING instead of READY).")
@click.option("--generate", is_flag=True, help="Probe with a one-token generation too, not only /health.")
@with_app
def status(app: App, job_ids, no_probe, generate) -> None:
    """State of JOB_IDS, or of all my tgi-hpc jobs (active first, newest first). A job array's id (4148)
    stands for its tasks; a batch (its --output file) for every job it submitted: each row of a batch job
    says how far the batch is (done/total, failed, tok/s, ETA).

    \b
    PENDING (Slurm's reason), STARTING (loading), LISTENING (endpoint up, not probed: --no-probe),
    READY (answers /health; --generate: a real generation too), ENDING, or how it ended
    (COMPLETED, FAILED, CANCELLED, TIMEOUT...). AGE is Slurm's run time.
    """
    from tgi_hpc.slurm import jobs

    probe = False if no_probe else ("generate" if generate else True)
    cluster = app.cluster()
    from tgi_hpc.batch.logs import job_ids_of
    from tgi_hpc.batch.status import add_progress

    ids = [j for target in job_ids for j in (job_ids_of(cluster, target) if _is_path(target) else [target])]
    rows = jobs.status(cluster, ids or None, with_probe=probe)

    add_progress(cluster, rows)       # batch jobs: done/total from their ledger
    if not rows and not app.json_output:
        app.info("no tgi-hpc jobs")
        return
    app.emit([st.to_dict() for st in rows], lambda: _table(rows))
    unknown = [st.job_id for st in rows if st.state == "UNKNOWN"]
    if unknown:
        from tgi_hpc.errors import SlurmError

        raise SlurmError(f"no such job: {' '.join(unknown)}")


@click.command()
@click.argument("job_id")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new output until the job ends (one job or task).")
@with_app
def logs(app: App, job_id, follow) -> None:
    """Print the output of JOB_ID: a job, an array task (4148_2), every task of a job array (4148), or
    every job of a batch (its --output file)."""
    from tgi_hpc.slurm import jobs

    cluster = app.cluster()
    if not follow:
        from tgi_hpc.batch.logs import logs as read_logs

        found = read_logs(cluster, job_id)
        text = "".join(found.values()) if list(found) == [job_id] else "".join(
            f"==> {name} <==\n{log}" + ("" if log.endswith("\n") or not log else "\n") for name, log in found.items())
        app.emit({"job_id": job_id, "log": text, "logs": found}, lambda: click.echo(text, nl=False))
        return
    from tgi_hpc.batch.logs import followed

    job_id = followed(cluster, job_id)       # an array task, not the array
    for chunk in jobs.follow(cluster, job_id):  # with --json: one JSON object per chunk (JSON lines)
        if app.json_output:
            click.echo(json.dumps({"job_id": job_id, "log": chunk}))
        else:
            click.echo(chunk, nl=False)


@click.command()
@click.argument("job_ids", nargs=-1)
@click.option("--all", "all_jobs", is_flag=True, help="Stop all my tgi-hpc jobs.")
@click.option("--replica", is_flag=True, help="JOB_IDS are jobs of a service: cancel just them, and the service "
              "replaces each with its successor (without it, a service's job is refused: stop SERVICE).")
@with_app
def stop(app: App, job_ids, all_jobs, replica) -> None:
    """Cancel JOB_IDS (or --all of my tgi-hpc jobs); a SERVICE name stops the whole service.

    A job of a service is refused (its successor would start and the service go on): `stop SERVICE`
    stops the service, `stop JOB --replica` replaces just that job.
    """
    from tgi_hpc.errors import UsageError
    from tgi_hpc.slurm import jobs

    if bool(job_ids) == all_jobs:
        raise UsageError("give job ids or --all (not both)")
    if replica and all_jobs:
        raise UsageError("--replica names jobs of a service; it does not go with --all")
    from tgi_hpc.cli.service import stop_services

    cluster = app.cluster()
    left = stop_services(app, cluster, list(job_ids), all_jobs, replica=replica)
    if left is None and not all_jobs:   # only services were named
        return
    result = jobs.stop(cluster, None if all_jobs else left)
    lines = [f"stopped {' '.join(result.stopped)}"] if result.stopped else []
    lines = [f"{line} (replaced by its service)" for line in lines] if replica else lines
    lines += [f"job {j} had already ended ({state})" for j, state in result.ended.items()]
    app.emit({"stopped": result.stopped, "already_ended": result.ended}, "\n".join(lines) or "nothing to stop")
