"""`tgi-hpc list [MODEL]`: the profile's catalog, what is ready to serve, and what serve would ask for."""
from __future__ import annotations

import click

from tgi_hpc.cli._app import App, with_app


def _columns(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def _listing_text(listing) -> str:
    rows = [["SIZE", "GPUS", "GPU TYPE", "PARTITION", "TIME", "CPUS", "MEM"]]
    rows += [[f"{r.label} (<= {r.max_params_b:g}B)", str(r.gpus or 0), r.gpu_type or r.constraint or "any",
              r.partition or "-", r.time or "-", str(r.cpus_per_task or "-"), r.mem or "-"] for r in listing.catalog]
    lines = [f"profile {listing.profile}{f' ({listing.cluster})' if listing.cluster else ''}: what serve asks for, by model size (parameters at 2 bytes each)"]
    lines += [_columns(rows)] if listing.catalog else ["  (no catalog: serve uses slurm.defaults.serve)"]
    ready = [m for m in listing.ready if m.complete]
    lines += ["", "ready to serve (shared: read-only, no download needed):" if ready else "nothing ready to serve yet"]
    lines += [_columns([[m.where, m.name, m.path] for m in ready])] if ready else []
    partial = [m for m in listing.ready if not m.complete]
    lines += [f"incomplete (download again): {', '.join(m.name for m in partial)}"] if partial else []
    lines += ["", "details for one model: tgi-hpc list MODEL"]
    return "\n".join(lines)


def _plan_text(plan) -> str:
    res = plan.resources
    lines = [f"{plan.model}: {plan.where} copy at {plan.path} ({'ready' if plan.ready else 'not ready'})"]
    lines += [f"  missing: {p}" for p in plan.problems]
    lines += [f"  size: {plan.size_b:g}B at 2 bytes a parameter" if plan.size_b is not None else "  size: unknown"]
    lines += ["  serve asks for: " + ", ".join(f"{k}={v}" for k, v in res.items())
              + (f", {plan.nodes} nodes" if plan.nodes > 1 else "") + f"; tensor parallel {plan.tensor_parallel}"]
    lines += [f"  why: {why}" for why in plan.why]
    lines += [f"  serve would refuse it: {plan.refused}"] if plan.refused else []
    lines += [f"  next: {plan.next_step}"]
    return "\n".join(lines)


@click.command("list")
@click.argument("model", required=False)
@with_app
def list_cmd(app: App, model) -> None:
    """The profile's catalog (GPUs, partition, time, memory per model size) and the models ready to serve
    (shared read-only weights such as Mila's /network/weights, and the model store); for MODEL, what
    `serve --model MODEL` would ask for, and why."""
    from tgi_hpc.workflows.catalog import list_models, plan_serve

    cluster = app.cluster()
    if model is None:
        listing = list_models(cluster)
        app.emit(listing.to_dict(), _listing_text(listing))
        return
    plan = plan_serve(cluster, model)
    app.emit(plan.to_dict(), _plan_text(plan))
