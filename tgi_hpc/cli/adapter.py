"""`tgi-hpc adapter load|unload|list JOB|SERVICE`: LoRA adapters loaded into a running server, and out of it."""
from __future__ import annotations

import click

from tgi_hpc.cli._app import App, with_app

_MODEL = click.option("--model", "-m", help="A job serving several models: the adapter's base model.")
_TIMEOUT = click.option("--timeout", default=600.0, show_default=True, help="Seconds to wait for the job to be READY.")


@click.group()
def adapter() -> None:
    """LoRA adapters loaded into, and unloaded from, a running server (it runs with --enable-runtime-lora).

    \b
    tgi-hpc adapter load JOB|SERVICE NAME=PATH     load the adapter in folder PATH (or ORG/ADAPTER from the store)
    tgi-hpc adapter unload JOB|SERVICE NAME        unload it once its requests in flight have finished
    tgi-hpc adapter list [JOB|SERVICE]             the adapters each server has

    On a service every READY replica gets the call, and its successors start with the adapter.
    Requests name the adapter as their model (OpenAI `model`, TGI `adapter_id`)."""


@adapter.command("load")
@click.argument("target", metavar="JOB|SERVICE")
@click.argument("item", metavar="NAME=PATH")
@_MODEL
@_TIMEOUT
@with_app
def load(app: App, target, item, model, timeout) -> None:
    """Load adapter NAME from PATH, a folder where the server runs (or ORG/ADAPTER from the model store)."""
    from tgi_hpc.workflows.runtime_adapters import load_adapter

    change = load_adapter(app.cluster(), target, item, model=model, timeout=timeout, progress=app.info)
    app.emit(change.to_dict(), change.summary())


@adapter.command("unload")
@click.argument("target", metavar="JOB|SERVICE")
@click.argument("name")
@_MODEL
@_TIMEOUT
@with_app
def unload(app: App, target, name, model, timeout) -> None:
    """Unload adapter NAME; new requests for it are refused at once, those in flight finish first."""
    from tgi_hpc.workflows.runtime_adapters import unload_adapter

    change = unload_adapter(app.cluster(), target, name, model=model, timeout=timeout, progress=app.info)
    app.emit(change.to_dict(), change.summary())


@adapter.command("list")
@click.argument("target", metavar="[JOB|SERVICE]", required=False)
@_MODEL
@_TIMEOUT
@with_app
def list_cmd(app: App, target, model, timeout) -> None:
    """The adapters each server of JOB or SERVICE has (default: my newest running serve job)."""
    from tgi_hpc.workflows.runtime_adapters import list_adapters

    listing = list_adapters(app.cluster(), target, model=model, timeout=timeout, progress=app.info)
    app.emit(listing, lambda: _print(listing))


def _print(listing: dict) -> None:
    for job_id, server in listing["servers"].items():
        names = ", ".join(server["adapters"]) or "(none)"
        click.echo(f"{job_id}  {server['model']}: {names}")
    for name, path in listing.get("recorded", {}).items():
        click.echo(f"recorded for successors: {name}={path}")
