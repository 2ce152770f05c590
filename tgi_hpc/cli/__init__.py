"""The `tgi-hpc` command. Wiring only: each command lives in its own module and calls one library function."""
from __future__ import annotations

import sys

import click

from tgi_hpc import __version__
from tgi_hpc.cli._app import global_options
from tgi_hpc.cli.adapter import adapter
from tgi_hpc.cli.batch import batch
from tgi_hpc.cli.bench import bench
from tgi_hpc.cli.catalog import list_cmd
from tgi_hpc.cli.compile import compile_command, release
from tgi_hpc.cli.chat import chat
from tgi_hpc.cli.completion import completion
from tgi_hpc.cli.download import download, models
from tgi_hpc.cli.jobs import logs, status, stop
from tgi_hpc.cli.metrics import metrics
from tgi_hpc.cli.profiles import profiles
from tgi_hpc.cli.serve import serve
from tgi_hpc.cli.service import endpoint
from tgi_hpc.cli.tunnel import ssh_config, tunnel


EXIT_CODES = """\b
Exit codes:
  0   success
  1   other error (a file or connection problem)
  2   bad usage: an option, or a job the cluster's rules refuse (the page is cited)
  3   profile error (file and key named), or a missing --account
  4   a job script could not be rendered (an unsafe value)
  5   Slurm refused or failed (sbatch, squeue, sacct, scancel), or no such job
  6   the job ended (FAILED, CANCELLED, TIMEOUT...) before it was ready; its log's end is shown
  7   still not ready after --timeout (the job keeps running)
  8   model not found, or its snapshot is incomplete
  9   download failed
  10  engine release missing or broken
  11  SSH connection, authentication or host key problem
  12  tunnel could not be set up
  130 interrupted (Ctrl-C)"""


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100}, epilog=EXIT_CODES)
@click.version_option(__version__, prog_name="tgi-hpc")
@global_options
def cli() -> None:
    """Serve open LLMs on Slurm clusters (Mila, DRAC, PAICE) with a TGI/OpenAI-compatible engine.

    \b
    tgi-hpc list [MODEL]                   what this cluster serves, with which resources, and what is ready
    tgi-hpc download --model ORG/NAME      store weights in the cluster's model store
    tgi-hpc compile                        build the offline engine release once
    tgi-hpc serve --model ORG/NAME --wait  submit a server job and wait until it answers
    tgi-hpc status | logs JOB | stop JOB   watch and manage your jobs
    tgi-hpc metrics JOB | chat JOB         live numbers of a server, or talk to it
    """


for command in (serve, status, logs, stop, metrics, chat, download, models, compile_command, release, profiles, tunnel,
                ssh_config, completion, endpoint, batch, bench, list_cmd, adapter):
    cli.add_command(command)


def main(argv: list[str] | None = None) -> int:
    """Entry point: the one place where toolkit errors become messages and exit codes."""
    from tgi_hpc.errors import TgiHpcError

    try:
        cli.main(args=argv, prog_name="tgi-hpc", standalone_mode=False)
    except TgiHpcError as exc:
        click.echo(f"error: {exc}", err=True)
        return exc.exit_code
    except OSError as exc:  # a file or connection problem outside our own checks: a message, not a traceback
        click.echo(f"error: {exc}", err=True)
        return 1
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        return 130
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except Exception as exc:
        if type(exc).__module__.split(".")[0] != "paramiko":
            raise
        click.echo(f"error: SSH: {exc} (run with -vv for details)", err=True)
        return 11
    return 0


if __name__ == "__main__":
    sys.exit(main())
