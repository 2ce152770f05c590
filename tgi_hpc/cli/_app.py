"""The object every command receives: output mode, verbosity, and the cluster it works on."""
from __future__ import annotations

import functools
import json
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import click


@dataclass
class App:
    cluster_name: str | None = None
    overrides: list[str] = field(default_factory=list)
    json_output: bool = False
    verbosity: int = 0
    remote: bool | None = None
    accept_host_key: bool = False

    def cluster(self, *, strict_paths: bool = True):
        from tgi_hpc.slurm.cluster import open_cluster

        return open_cluster(self.cluster_name, self.overrides, remote=self.remote, strict_paths=strict_paths,
                            accept_host_key=self.accept_host_key)

    def emit(self, data: Any, human: Callable[[], None] | str | None = None) -> None:
        """Results go to stdout: JSON with --json, else the human form."""
        if self.json_output:
            click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))
        elif callable(human):
            human()
        elif human is not None:
            click.echo(human)

    def again(self) -> str:
        """The global options that reach this same cluster again, quoted to paste into a printed command."""
        import shlex

        words = ["--cluster", self.cluster_name] if self.cluster_name else []
        for item in self.overrides:
            words += ["--set", item]
        words += ["--remote"] if self.remote else (["--no-remote"] if self.remote is False else [])
        return "".join(" " + shlex.quote(w) for w in words)

    def info(self, message: str) -> None:
        """Progress and hints go to stderr, so stdout stays parseable."""
        if self.verbosity >= 0:
            click.echo(message, err=True)


def setup_logging(verbosity: int) -> None:
    level = logging.WARNING - 10 * verbosity
    logging.basicConfig(level=max(logging.DEBUG, level), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpcore", "paramiko"):  # one line per request/packet: only with -vv
        logging.getLogger(noisy).setLevel(max(level, logging.WARNING if verbosity < 2 else logging.DEBUG))


def _global_options(with_env: bool) -> list:
    env = (lambda name: {"envvar": name}) if with_env else (lambda name: {})
    return [
        click.option("--cluster", "-c", "cluster_name", **env("TGI_HPC_CLUSTER"),
                     help="Profile or cluster: local, mila, computecanada (fir, nibi, rorqual, narval, trillium, rocky), "
                          "paice (tamia, killarney, vulcan), or a YAML path. Default: detected on the login node, "
                          "else local. [env: TGI_HPC_CLUSTER]"),
        click.option("--set", "overrides", multiple=True, **env("TGI_HPC_SET"), metavar="KEY=VALUE",
                     help="Override a profile value, e.g. --set slurm.account=def-x. [env: TGI_HPC_SET]"),
        click.option("--json", "json_output", is_flag=True, **env("TGI_HPC_JSON"),
                     help="Print results as JSON. [env: TGI_HPC_JSON]"),
        click.option("-v", "--verbose", count=True, **env("TGI_HPC_VERBOSE"),
                     help="More logs on stderr. [env: TGI_HPC_VERBOSE]"),
        click.option("-q", "--quiet", count=True, help="Fewer messages on stderr."),
        click.option("--remote/--no-remote", default=None, **env("TGI_HPC_REMOTE"),
                     help="Run Slurm commands on the profile's login host over SSH. Default: only when "
                          "sbatch is missing here. [env: TGI_HPC_REMOTE]"),
        click.option("--accept-host-key", is_flag=True, **env("TGI_HPC_ACCEPT_HOST_KEY"),
                     help="Trust an SSH host key not yet in known_hosts and record it (check its fingerprint, "
                          "printed without this flag, first). [env: TGI_HPC_ACCEPT_HOST_KEY]"),
    ]


def global_options(func):
    """The same options on the root group (`tgi-hpc --cluster mila serve ...`), kept in ctx.obj.
    Environment twins are read at the command level only, so nothing is counted twice."""

    @functools.wraps(func)
    def wrapper(**values):
        click.get_current_context().obj = values
        return func()

    for option in reversed(_global_options(with_env=False)):
        wrapper = option(wrapper)
    return wrapper


def with_app(func):
    """Give a command the App built from --cluster, --set, --json, -v/-q, --remote, --accept-host-key (each with a
    TGI_HPC_* twin);
    options given before the command (on the root group) count too, the command's own win."""

    @functools.wraps(func)
    def wrapper(*args, cluster_name, overrides, json_output, verbose, quiet, remote, accept_host_key, **kwargs):
        root = click.get_current_context().find_root().obj or {}
        verbosity = verbose + root.get("verbose", 0) - quiet - root.get("quiet", 0)
        setup_logging(verbosity)
        app = App(cluster_name or root.get("cluster_name"), [*root.get("overrides", ()), *overrides],
                  json_output or root.get("json_output", False), verbosity,
                  remote if remote is not None else root.get("remote"),
                  accept_host_key or root.get("accept_host_key", False))
        return func(app, *args, **kwargs)

    for option in reversed(_global_options(with_env=True)):
        wrapper = option(wrapper)
    return wrapper


class DefaultGroup(click.Group):
    """A group whose first argument, when it is not a subcommand, goes to `default_command`
    (`tgi-hpc models --json` = `models list --json`; `tgi-hpc tunnel 4148` = `tunnel open 4148`)."""

    default_command = "list"

    def parse_args(self, ctx, args):
        if not args or (args[0] not in self.commands and args[0] not in ("-h", "--help")):
            args = [self.default_command, *args]
        return super().parse_args(ctx, args)

    def format_usage(self, ctx, formatter):
        formatter.write_usage(ctx.command_path, f"[{self.default_command}] [ARGS]... | COMMAND [ARGS]...")

    def format_commands(self, ctx, formatter):
        rows = []
        for name in self.list_commands(ctx):
            command = self.get_command(ctx, name)
            if command is not None and not command.hidden:
                short = command.get_short_help_str(limit=formatter.width - 20)
                rows.append((name, f"(default) {short}" if name == self.default_command else short))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


class OpenByDefault(DefaultGroup):
    default_command = "open"
