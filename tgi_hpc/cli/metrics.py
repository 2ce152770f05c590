"""`tgi-hpc metrics [JOB]`: a serve job's live numbers from its /metrics, or one sample with --json."""
from __future__ import annotations

import click

from tgi_hpc.cli._app import App, with_app


def _fmt(value: float | None, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def _table(summary):
    from rich.table import Table

    what = f"service {summary.target} ({len(summary.replicas)} replicas)" if len(summary.replicas) > 1 or \
        summary.replicas != [summary.target] else f"job {summary.target}"
    table = Table(title=f"{what}  {summary.url}", box=None, pad_edge=False, show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_column(style="dim")
    counters = summary.counters
    rows = [
        ("prompt", _fmt(summary.prompt_tokens_per_s, "{:.1f} tok/s"), f"{counters.get('prompt_tokens', 0):.0f} since start"),
        ("generated", _fmt(summary.generated_tokens_per_s, "{:.1f} tok/s"),
         f"{counters.get('generated_tokens', 0):.0f} since start"),
        ("requests", _fmt(summary.requests_per_s, "{:.2f} /s"),
         f"{counters.get('requests', 0):.0f} done, {counters.get('failures', 0):.0f} failed"),
        ("running", _fmt(summary.running, "{:.0f}"), ""),
        ("waiting", _fmt(summary.waiting, "{:.0f}"), ""),
        ("KV cache", _fmt(summary.kv_cache_usage and 100 * summary.kv_cache_usage, "{:.1f} %"), "of its blocks in use"),
        ("prefix hits", _fmt(summary.prefix_hit_rate and 100 * summary.prefix_hit_rate, "{:.1f} %"),
         "" if summary.prefix_hit_rate is not None else "not reported by this server"),
        ("latency p50", _fmt(summary.latency_p50_s, "{:.3f} s"), summary.latency_scope),
        ("latency p90", _fmt(summary.latency_p90_s, "{:.3f} s"), summary.latency_scope),
    ]
    for row in rows:
        table.add_row(*row)
    table.caption = f"rates over the last {summary.window_s:.0f} s; tokens from {summary.token_source}; Ctrl-C to leave"
    return table


@click.command()
@click.argument("target", metavar="[JOB|SERVICE]", required=False)
@click.option("--interval", default=1.0, show_default=True, type=click.FloatRange(min=0.1),
              help="Seconds between scrapes (with --json: between the two scrapes of the sample).")
@click.option("--window", default=10.0, show_default=True, type=click.FloatRange(min=1),
              help="Rates over this many seconds of scrapes (the live view).")
@click.option("--timeout", default=600.0, show_default=True, help="Seconds to wait for the job to be READY.")
@with_app
def metrics(app: App, target, interval, window, timeout) -> None:
    """Live numbers of JOB's server or SERVICE's replicas (default: my newest running serve job), from /metrics.

    Prompt and generated tokens/s, requests/s, running and waiting requests, KV-cache usage, prefix-cache hit
    rate, p50/p90 request latency; rates as Prometheus' rate() computes them, over --window seconds (a
    service: each replica scraped on its own, then added up).
    With --json, one sample: two scrapes --interval apart, the rates between them and the counters."""
    from tgi_hpc.workflows import access, scrape

    with access.connect(app.cluster(), target, timeout=timeout, progress=app.info) as found:
        fleet = scrape.Fleet(found.replicas, found.headers)
        try:
            if app.json_output:
                summary = scrape.sample(fleet, interval)
                summary.target, summary.url = found.job_id, found.url
                app.emit(summary.to_dict())
                return
            _live(scrape.watch(fleet, interval, window), found)
        finally:
            fleet.close()


def _live(summaries, found) -> None:
    from rich.live import Live

    try:
        with Live(auto_refresh=False) as live:
            for summary in summaries:
                summary.target, summary.url = found.job_id, found.url
                live.update(_table(summary), refresh=True)
    except KeyboardInterrupt:
        pass
