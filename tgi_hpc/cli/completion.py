"""`tgi-hpc completion SHELL`: print the shell completion script (click's own)."""
from __future__ import annotations

import click


@click.command()
@click.argument("shell", type=click.Choice(["bash", "zsh", "fish"]))
def completion(shell: str) -> None:
    """Print the completion script; e.g. `eval "$(tgi-hpc completion bash)"` in ~/.bashrc."""
    from click.shell_completion import get_completion_class

    root = click.get_current_context().find_root().command  # the `tgi-hpc` group, without importing it
    comp = get_completion_class(shell)(root, {}, "tgi-hpc", "_TGI_HPC_COMPLETE")
    click.echo(comp.source())
