"""`tgi-hpc bench JOB|SERVICE`: a load test of a running server (tgi_hpc/workflows/bench.py)."""
from __future__ import annotations

import click

from tgi_hpc.cli._app import App, with_app


def _table(summary: dict) -> None:
    def ms(value) -> str:
        return "-" if value is None else f"{value * 1000:.1f}"

    click.echo(f"{summary['completed']}/{summary['requests']} requests at concurrency {summary['concurrency']} "
               f"in {summary['seconds']:.1f} s: {summary['requests_per_s']:.2f} req/s, "
               f"{summary['tokens_per_s']:.1f} generated tok/s" + (f", {summary['failed']} failed" if summary["failed"]
                                                                  else ""))
    click.echo(f"{'ms':<6}{'p50':>10}{'p90':>10}{'p99':>10}{'mean':>10}")
    for name in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        row = summary[name]
        click.echo(f"{name[:-2].upper():<6}" + "".join(f"{ms(row[k]):>10}" for k in ("p50", "p90", "p99", "mean")))
    for error in summary["errors"]:
        click.echo(f"error: {error}")
    if summary.get("saved"):
        click.echo(f"saved: {summary['saved']}")


@click.command()
@click.argument("target", required=False)
@click.option("--concurrency", type=click.IntRange(min=1), default=8, show_default=True,
              help="Closed-loop streaming clients.")
@click.option("--requests", "-n", "num_requests", type=click.IntRange(min=1),
              help="Requests in all (default: 4 per client).")
@click.option("--new-tokens", type=click.IntRange(min=1), default=64, show_default=True, help="max_tokens per request.")
@click.option("--timeout", default=600.0, show_default=True, help="Seconds to wait for READY, and for the run.")
@with_app
def bench(app: App, target, concurrency, num_requests, new_tokens, timeout) -> None:
    """Load TARGET (a job id or service name; default: my newest server) with streaming /v1/completions
    clients and print TTFT, TPOT, ITL and end-to-end latency percentiles and throughput."""
    from tgi_hpc.workflows.bench import LoadOptions, bench as run_bench

    opts = LoadOptions(concurrency=concurrency, num_requests=num_requests, new_tokens=new_tokens, timeout_s=timeout)
    summary = run_bench(app.cluster(), target, opts, timeout=timeout, progress=app.info)
    app.emit(summary, lambda: _table(summary))
