"""`tgi-hpc metrics [JOB]`: a serve job's live numbers from its /metrics, or one sample with --json."""
from __future__ import annotations

import click

from tgi_hpc.cli._app import App, with_app


def _fmt(value: float | None, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def _table(summary, title: str):
    from rich.table import Table

    table = Table(title=title, box=None, pad_edge=False, show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_column(style="dim")
    counters = summary.counters
    rows = [
        ("server", "", summary.url),
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
    window = f"rates over the last {summary.window_s:.0f} s" if summary.window_s else "rates after the next scrape"
    table.caption = f"{window}; tokens from {summary.token_source}; Ctrl-C to leave"
    return table


@click.command()
@click.argument("target", metavar="[JOB|SERVICE]", required=False)
@click.option("--model", "-m", help="A job serving several models (or adapters): the one to read (default: all of them).")
@click.option("--interval", default=1.0, show_default=True, type=click.FloatRange(min=0.1),
              help="Seconds between scrapes (with --json: between the two scrapes of the sample).")
@click.option("--window", default=10.0, show_default=True, type=click.FloatRange(min=1),
              help="Rates over this many seconds of scrapes (the live view).")
@click.option("--timeout", default=600.0, show_default=True, help="Seconds to wait for the job to be READY.")
@with_app
def metrics(app: App, target, model, interval, window, timeout) -> None:
    """Live numbers of JOB's server or SERVICE's replicas (default: my newest running serve job), from /metrics.

    Prompt and generated tokens/s, requests/s, running and waiting requests, KV-cache usage, prefix-cache hit
    rate, p50/p90 request latency; rates as Prometheus' rate() computes them, over --window seconds (a
    service: each replica scraped on its own, then added up).
    With --json, one sample: two scrapes --interval apart, the rates between them and the counters."""
    from tgi_hpc.workflows import access, scrape

    with access.connect(app.cluster(), target, model=model, timeout=timeout, progress=app.info) as found:
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
    """Redrawn in place on a terminal; elsewhere (a pipe, TERM=dumb) one table after the other."""
    from rich.console import Console
    from rich.live import Live

    console = Console()
    try:
        tables = (_table(s, _title(found, s)) for s in _named(summaries, found))
        if not console.is_terminal or console.is_dumb_terminal:
            for table in tables:
                console.print(table)
            return
        with Live(console=console, auto_refresh=False) as live:
            for table in tables:
                live.update(table, refresh=True)
    except KeyboardInterrupt:
        pass


def _named(summaries, found):
    for summary in summaries:
        summary.target, summary.url = found.job_id, found.url
        yield summary


def _title(found, summary) -> str:
    count = len(summary.replicas)
    if found.service:
        return f"service {found.job_id} ({count} replica{'s' if count != 1 else ''} READY)"
    return f"job {found.job_id}" + (f" ({count} models)" if count > 1 else "")
