"""`tgi-hpc batch`: run a JSONL file of requests through Slurm jobs (tgi_hpc/batch/), resumable."""
from __future__ import annotations

import sys
from typing import IO, Any

import click

from tgi_hpc.cli._app import App, with_app
from tgi_hpc.cli.serve import _limit_options
from tgi_hpc.models.quantization import SUPPORTED


class ProgressView:
    """`batch --wait` on stderr: a rich bar with done/total, failed, tok/s and ETA on a terminal; elsewhere
    (a pipe, a file, a job's log) a plain line each time done/total moves."""

    def __init__(self, app: App, stream: IO[str] | None = None):
        from tgi_hpc.batch.submission import line_per_change

        self.stream = stream or sys.stderr
        self.plain, self.bar, self.task = line_per_change(app.info), None, None
        self.live = self.stream.isatty() and app.verbosity >= 0

    def __enter__(self) -> ProgressView:
        if self.live:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("batch"), BarColumn(), TextColumn("{task.fields[line]}"),
                                TimeElapsedColumn(), console=Console(file=self.stream), transient=False)
            self.bar.start()
            self.task = self.bar.add_task("batch", total=None, line="waiting for the first shard")
        return self

    def __call__(self, p: Any) -> None:
        if self.bar is None:
            self.plain(p)
        else:
            self.bar.update(self.task, total=p.total, completed=p.done, line=p.describe())

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()


@click.command()
@click.option("--model", "-m", required=True, help="Hub id in the model store (ORG/NAME) or a local snapshot directory.")
@click.option("--input", "-i", "input_path", required=True, type=click.Path(dir_okay=False),
              help="Requests, one per line: OpenAI Batch lines (custom_id, method, url, body for /v1/chat/completions "
                   "or /v1/completions; /v1/embeddings with an embedding model, not mixed with the others) or "
                   "plain {\"messages\": ...} / {\"prompt\": ...} lines (id: the line number).")
@click.option("--output", "-o", "output_path", required=True, type=click.Path(dir_okay=False),
              help="Results, OpenAI's Batch output format, one line per request in input order. The batch's "
                   "state lives beside it in OUTPUT.tgi-batch/.")
@click.option("--jobs", "-j", "num_jobs", type=click.IntRange(min=1, max=1000), default=1, show_default=True,
              help="Jobs working on the batch at once (on Slurm: one job array of that many tasks); each takes "
                   "the next free shard as it finishes one.")
@click.option("--gpus", type=click.IntRange(min=0), help="GPUs per job (default: from the model size).")
@click.option("--workers", type=click.IntRange(min=1, max=256), default=1, show_default=True,
              help="Engine processes per job, splitting its CPU threads and taking shards from the same ledger: "
                   "on CPU, N single-threaded forwards outrun one N-thread forward (N copies of the weights: "
                   "small models).")
@click.option("--time", "time_", help="Slurm time limit per job, e.g. 3:00:00 (the job requeues itself before it).")
@click.option("--partition", "-p", help="Slurm partition. Default: the profile's serve partition.")
@click.option("--revision", default="main", show_default=True, help="Revision of a stored Hub model.")
@click.option("--dtype", type=click.Choice(["float16", "bfloat16", "float32"]), help="Weights and compute dtype.")
@click.option("--quantize", type=click.Choice(["none", *SUPPORTED], case_sensitive=False), help="As for serve.")
@_limit_options
@click.option("--env", "env", multiple=True, metavar="NAME=VALUE", help="Extra environment variable for the jobs.")
@click.option("--engine-arg", "engine_args", multiple=True, metavar="FLAG=VALUE", help="Other engine flag, checked.")
@click.option("--release", help="Engine release directory. Default: the profile's current release.")
@click.option("--shard-size", type=click.IntRange(min=1),
              help="Requests per shard (the unit of commit and of work stealing; the requests finished inside a "
                   "shard survive a requeue or a kill whatever its size). Default: about 8 shards per job.")
@click.option("--lease", "lease_s", type=click.FloatRange(min=1), default=120.0, show_default=True,
              help="Seconds before the shard of a job that died without a word goes to another job.")
@click.option("--restart", is_flag=True, help="Start over when the input or model changed since the batch began "
                                              "(the old state is kept aside, its jobs stopped).")
@click.option("--no-requeue", is_flag=True, help="Do not requeue a job before its time limit (rerun to go on).")
@click.option("--wait/--no-wait", "wait_done", default=False,
              help="Wait until the output is complete: a progress bar on a terminal, else a line per change.")
@click.option("--timeout", default=24 * 3600.0, show_default=True, help="Seconds to wait with --wait.")
@click.option("--dry-run", is_flag=True, help="Print the job script; submit nothing.")
@with_app
def batch(app: App, model, input_path, output_path, num_jobs, gpus, workers, time_, partition, revision, dtype,
          quantize, env, engine_args, release, shard_size, lease_s, restart, no_requeue, wait_done, timeout, dry_run,
          **limits) -> None:
    """Answer every request of INPUT with MODEL in Slurm jobs, into OUTPUT. Run the same command again to
    see progress or, after jobs ended early, to go on where they stopped. `tgi-hpc logs OUTPUT` shows the
    logs of every job (every task of its job array)."""
    from tgi_hpc.batch.submission import BatchOptions, run_batch
    from tgi_hpc.workflows.serve import ServeOptions

    limits.update(dtype=dtype, quantize=quantize)
    serve = ServeOptions(model=model, revision=revision, gpus=gpus, time=time_, partition=partition, limits=limits,
                         env=list(env), engine_args=list(engine_args))
    opts = BatchOptions(serve, input_path, output_path, jobs=num_jobs, shard_size=shard_size, lease_s=lease_s,
                        restart=restart, requeue=not no_requeue, workers=workers)
    with ProgressView(app) as view:
        result = run_batch(app.cluster(strict_paths=not dry_run), opts, release=release, dry_run=dry_run,
                           wait=wait_done, timeout=timeout, progress=app.info, watch=view)
    if dry_run:
        app.emit({"script": result.script}, result.script)
        return
    app.emit(result.to_dict(), result.summary())
