"""`tgi-hpc bench JOB|SERVICE`: a load test of a running server (tgi_hpc/workflows/bench.py)."""
from __future__ import annotations

import click

from tgi_hpc.cli._app import App, with_app


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
    prefill (TTFT, prompt tok/s) and decode (TPOT, ITL, tok/s) tables by percentile, and the throughput."""
    from tgi_hpc.workflows.bench import LoadOptions, bench as run_bench, tables

    opts = LoadOptions(num_requests=num_requests, runs=runs, new_tokens=new_tokens, timeout_s=timeout, warmup=warmup,
                       openai=not generate_stream, sequence_length=sequence_length)
    result = run_bench(app.cluster(), target, opts, concurrencies=list(concurrencies), timeout=timeout,
                       progress=app.info)
    app.emit(result, lambda: click.echo(tables(result["runs"]) + (f"\nsaved: {result['saved']}"
                                                                   if result.get("saved") else "")))
