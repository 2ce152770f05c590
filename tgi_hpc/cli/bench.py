"""`tgi-hpc bench JOB|SERVICE`: a load test of a running server (tgi_hpc/workflows/bench.py)."""
from __future__ import annotations

import sys
import time
from typing import IO, Any

import click

from tgi_hpc.cli._app import App, with_app


class LiveView:
    """`bench` on a terminal: a rich table on stderr, a row per concurrency level, redrawn as requests end
    (at most every `every_s`, and at each level's last one): requests done/sent, failed, generated tok/s,
    TTFT and TPOT p50/p90. Off with --json, -q, or when stderr is not a terminal (the tables still print)."""

    def __init__(self, app: App, stream: IO[str] | None = None, every_s: float = 0.25):
        self.stream = stream or sys.stderr
        self.on = self.stream.isatty() and app.verbosity >= 0 and not app.json_output
        self.every_s, self.live, self.rows, self.drawn = every_s, None, {}, 0.0

    def __enter__(self) -> LiveView:
        if self.on:
            from rich.console import Console
            from rich.live import Live

            self.live = Live(self.table(), console=Console(file=self.stream), auto_refresh=False, transient=False)
            self.live.start()
        return self

    def __call__(self, level: int, records: list[Any], sent: int) -> None:
        if self.live is None:
            return
        from tgi_hpc.workflows.bench import summarize

        now = time.monotonic()
        if now - self.drawn < self.every_s and len(records) < sent:
            return
        self.drawn = now
        self.rows[level] = (summarize(records, level), sent)
        self.live.update(self.table(), refresh=True)

    def table(self) -> Any:
        from rich.table import Table

        from tgi_hpc.workflows.bench import _cell

        table = Table(title="tgi-hpc bench", box=None, pad_edge=False)
        for column in ("clients", "done", "failed", "tok/s", "TTFT p50 ms", "TTFT p90 ms", "TPOT p50 ms",
                       "TPOT p90 ms"):
            table.add_column(column, justify="right")
        for level, (run, sent) in self.rows.items():
            table.add_row(str(level), f"{run['requests']}/{sent}", str(run["failed"]), f"{run['tokens_per_s']:.1f}",
                          _cell(run["ttft_s"]["p50"], 1e3), _cell(run["ttft_s"]["p90"], 1e3),
                          _cell(run["tpot_s"]["p50"], 1e3), _cell(run["tpot_s"]["p90"], 1e3))
        return table

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            self.live.stop()


@click.command()
@click.argument("target", required=False)
@click.option("--concurrency", "--batch-size", "concurrencies", type=click.IntRange(min=1), multiple=True, default=(8,),
              show_default=True, help="Closed-loop streaming clients; repeat for a row per level (1, 8, 32...).")
@click.option("--requests", "-n", "num_requests", type=click.IntRange(min=1),
              help="Requests per level (default: --runs per client).")
@click.option("--runs", type=click.IntRange(min=1), default=4, show_default=True,
              help="Requests per client at each level, when --requests is not given.")
@click.option("--sequence-length", type=click.IntRange(min=1),
              help="Prompt tokens of every request, exactly (token ids from the server's /tokenize; with "
                   "--generate-stream, TGI's `truncate`). Default: the built-in prompts (6 to 19 tokens with SmolLM2).")
@click.option("--new-tokens", "--decode-length", type=click.IntRange(min=1), default=64, show_default=True,
              help="max_tokens per request (greedy).")
@click.option("--warmup", type=click.IntRange(min=0), default=0, show_default=True,
              help="Requests sent before each level's measured ones, not counted.")
@click.option("--generate-stream", is_flag=True, help="TGI's /generate_stream instead of /v1/completions.")
@click.option("--timeout", type=click.FloatRange(min=1), default=600.0, show_default=True,
              help="Seconds to wait for READY, and for each level's run.")
@with_app
def bench(app: App, target, concurrencies, num_requests, runs, sequence_length, new_tokens, warmup, generate_stream,
          timeout) -> None:
    """Load TARGET (a job id or service name; default: my newest server) with streaming clients and print the
    prefill (TTFT, prompt tok/s) and decode (TPOT, ITL, tok/s) tables by percentile, and the throughput. On a
    terminal, a live view on stderr follows each level as its requests end (not with --json or -q)."""
    from tgi_hpc.workflows.bench import LoadOptions, bench as run_bench, tables

    opts = LoadOptions(num_requests=num_requests, runs=runs, new_tokens=new_tokens, timeout_s=timeout, warmup=warmup,
                       openai=not generate_stream, sequence_length=sequence_length)
    with LiveView(app) as view:
        result = run_bench(app.cluster(), target, opts, concurrencies=list(concurrencies), timeout=timeout,
                           progress=app.info, watch=view if view.on else None)
    app.emit(result, lambda: click.echo(tables(result["runs"]) + (f"\nsaved: {result['saved']}"
                                                                   if result.get("saved") else "")))
