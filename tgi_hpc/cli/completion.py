"""`tgi-hpc completion SHELL`: print the shell completion script (click's own)."""
from __future__ import annotations

import click


@click.command()
@click.argument("shell", type=click.Choice(["bash", "zsh", "fish"]))
def completion(shell: str) -> None:
    """Print the completion script; e.g. `eval "$(tgi-hpc completion bash)"` in ~/.bashrc."""
    from click.shell_completion import get_completion_class

    from tgi_hpc.cli import cli

    comp = get_completion_class(shell)(cli, {}, "tgi-hpc", "_TGI_HPC_COMPLETE")
    click.echo(comp.source())
