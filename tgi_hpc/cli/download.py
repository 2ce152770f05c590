"""`tgi-hpc download` (weights into the model store) and `tgi-hpc models` (what is stored)."""
from __future__ import annotations

import click

from tgi_hpc.cli._app import App, DefaultGroup, with_app


@click.command()
@click.option("--model", "-m", required=True, help="Hub id ORG/NAME.")
@click.option("--revision", default="main", show_default=True)
@click.option("--here/--job", "here", default=None,
              help="Download in this process (login node) or in a job on a partition with internet. "
                   "Default: the profile's network.download_on.")
@click.option("--store", help="Model store directory (default: the profile's paths.models).")
@click.option("--wait/--no-wait", "wait_done", default=True, show_default=True,
              help="As a job: wait until it ends and the snapshot is complete (--no-wait: return once submitted; "
                   "serve refuses the model until the snapshot is complete).")
@click.option("--dry-run", is_flag=True, help="With --job: print the job script; submit nothing.")
@with_app
def download(app: App, model, revision, here, store, wait_done, dry_run) -> None:
    """Store MODEL's safetensors, config and tokenizer in the model store (a PEFT adapter repo: its
    adapter_config.json and adapter_model.safetensors, for `serve --lora`)."""
    from tgi_hpc.workflows.prepare import run_download

    result = run_download(app.cluster(strict_paths=not dry_run), model, revision, here=here, store=store,
                          wait=wait_done, dry_run=dry_run, progress=app.info)
    result.again = app.again()
    app.emit(result.to_dict(), result.summary())


@click.group(cls=DefaultGroup)
def models() -> None:
    """List stored models (`models rm ID` removes one)."""


@models.command("list")
@with_app
def list_models_command(app: App) -> None:
    """List the models in the store: id, revision, size, format."""
    from tgi_hpc.workflows.prepare import list_stored

    rows = list_stored(app.cluster())

    def human() -> None:
        for r in rows:
            flag = ("" if r["complete"] else "  (incomplete)") + ("  (adapter)" if r.get("kind") == "adapter" else "")
            click.echo(f"{r['model_id']}@{r['revision']}  {r['size_bytes'] / 1e9:.2f} GB  {r['format']}{flag}")

    app.emit(rows, human)


@models.command("rm")
@click.argument("model_id")
@click.option("--revision", help="Only this revision (default: all).")
@with_app
def remove_command(app: App, model_id, revision) -> None:
    """Remove MODEL_ID from the store."""
    from tgi_hpc.workflows.prepare import remove_stored

    removed = remove_stored(app.cluster(), model_id, revision)
    app.emit({"removed": removed}, "\n".join(f"removed {p}" for p in removed))
