"""A serve job's live numbers from its Prometheus `/metrics`: token rates, queue, KV usage, prefix hits, latency.

Rates are counter increases over the scrapes in a window, divided by the time they span, as Prometheus'
`rate()` computes them (a value lower than the one before is a restart: the counter counts from zero again),
without `rate()`'s extrapolation to the window's edges. Latency quantiles interpolate inside the histogram
buckets as `histogram_quantile()` does. Token rates read the engine's token counters when it has them
(`tgi_prompt_tokens_total`, `tgi_generated_tokens_total`: counted each step), else TGI's per-request
histogram sums (counted when a request starts and ends, so they move in steps).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from prometheus_client.parser import text_string_to_metric_families

PROMPT_TOKENS = ("tgi_prompt_tokens_total", "tgi_request_input_length_sum")
GENERATED_TOKENS = ("tgi_generated_tokens_total", "tgi_request_generated_tokens_sum")
PREFIX_QUERIED, PREFIX_HIT = "tgi_prefix_cache_queried_tokens_total", "tgi_prefix_cache_hit_tokens_total"
REQUESTS, FAILURES = "tgi_request_success", "tgi_request_failure"
LATENCY = "tgi_request_duration"
GAUGES = {"running": "tgi_batch_current_size", "waiting": "tgi_queue_size", "kv_cache_usage": "tgi_kv_cache_usage"}


@dataclass(frozen=True)
class Scrape:
    """One `/metrics` answer: each sample name's value summed over its labels, histograms by bucket."""

    at: float                                            # time.monotonic() when it was read
    values: dict[str, float]
    buckets: dict[str, dict[float, float]] = field(default_factory=dict)   # histogram -> {le: cumulative count}


def parse_exposition(text: str, at: float) -> Scrape:
    """Prometheus text format -> Scrape (prometheus_client's parser; a malformed text raises ValueError)."""
    values: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_bucket") and "le" in sample.labels:
                per_le = buckets.setdefault(sample.name[: -len("_bucket")], {})
                le = float(sample.labels["le"])
                per_le[le] = per_le.get(le, 0.0) + sample.value
            else:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return Scrape(at, values, buckets)


def increase(series: list[float]) -> float:
    """How much a counter grew over consecutive readings; a drop is a reset, after which it counts from 0."""
    total = 0.0
    for before, now in zip(series, series[1:]):
        total += now if now < before else now - before
    return total


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """The q-quantile from cumulative bucket counts, interpolated linearly inside its bucket (the first bucket
    starts at 0); in the +Inf bucket, the highest finite bound. None without observations."""
    bounds = sorted(buckets)
    if not bounds or bounds[-1] != math.inf:
        return None
    counts, running = [], 0.0
    for le in bounds:                 # counts read from separate scrapes may dip: keep them monotonic
        running = max(running, buckets[le])
        counts.append(running)
    total = counts[-1]
    if total <= 0:
        return None
    rank = q * total
    i = next(i for i, count in enumerate(counts) if count >= rank)
    if bounds[i] == math.inf:
        return bounds[-2] if len(bounds) > 1 else None
    lower = bounds[i - 1] if i else 0.0
    below = counts[i - 1] if i else 0.0
    inside = counts[i] - below
    return bounds[i] if inside <= 0 else lower + (bounds[i] - lower) * (rank - below) / inside


@dataclass
class Summary:
    """What `tgi-hpc metrics` shows: rates over the window, gauges from the last scrape, counters since start.
    For a service, the sum over its replicas (KV usage: their mean; latency: their buckets together)."""

    window_s: float
    prompt_tokens_per_s: float | None = None
    generated_tokens_per_s: float | None = None
    requests_per_s: float | None = None
    running: float | None = None
    waiting: float | None = None
    kv_cache_usage: float | None = None
    prefix_hit_rate: float | None = None
    latency_p50_s: float | None = None
    latency_p90_s: float | None = None
    latency_scope: str = "none"        # "window" (requests that ended in it), "since start", or "none"
    token_source: str = "none"         # "counters", "histogram sums", "mixed" or "none"
    counters: dict[str, float] = field(default_factory=dict)
    target: str = ""                   # the job id or service name
    url: str = ""
    replicas: list[str] = field(default_factory=list)    # the jobs scraped

    def to_dict(self) -> dict:
        return asdict(self)


Series = list[list[Scrape]]            # per replica, its scrapes oldest first


def _first_present(scrape: Scrape, names: tuple[str, ...]) -> str | None:
    return next((name for name in names if name in scrape.values), None)


def _rate(scrapes: list[Scrape], name: str | None) -> float | None:
    span = scrapes[-1].at - scrapes[0].at
    if name is None or span <= 0 or any(name not in s.values for s in scrapes):
        return None
    return increase([s.values[name] for s in scrapes]) / span


def _total(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) if present else None


def _token_rates(series: Series, summary: Summary) -> None:
    prompt = [_first_present(scrapes[-1], PROMPT_TOKENS) for scrapes in series]
    generated = [_first_present(scrapes[-1], GENERATED_TOKENS) for scrapes in series]
    sources = {"counters" if name.endswith("_total") else "histogram sums" for name in prompt + generated if name}
    summary.token_source = sources.pop() if len(sources) == 1 else ("mixed" if sources else "none")
    summary.prompt_tokens_per_s = _total([_rate(scrapes, name) for scrapes, name in zip(series, prompt)])
    summary.generated_tokens_per_s = _total([_rate(scrapes, name) for scrapes, name in zip(series, generated)])
    summary.requests_per_s = _total([_rate(scrapes, REQUESTS if REQUESTS in scrapes[-1].values else None)
                                     for scrapes in series])
    totals = {"prompt_tokens": prompt, "generated_tokens": generated, "requests": [REQUESTS] * len(series),
              "failures": [FAILURES] * len(series), "prefix_cache_queried_tokens": [PREFIX_QUERIED] * len(series),
              "prefix_cache_hit_tokens": [PREFIX_HIT] * len(series)}
    for key, names in totals.items():
        value = _total([scrapes[-1].values.get(name) if name else None for scrapes, name in zip(series, names)])
        if value is not None:
            summary.counters[key] = value


def _bucket_increase(scrapes: list[Scrape], name: str) -> dict[float, float]:
    bounds = set.intersection(*(set(s.buckets.get(name, {})) for s in scrapes))
    return {le: increase([s.buckets[name][le] for s in scrapes]) for le in bounds}


def _add(into: dict[float, float], buckets: dict[float, float]) -> None:
    for le, count in buckets.items():
        into[le] = into.get(le, 0.0) + count


def _latency(series: Series, summary: Summary) -> None:
    window: dict[float, float] = {}
    since_start: dict[float, float] = {}
    for scrapes in series:
        if LATENCY in scrapes[-1].buckets:
            _add(since_start, scrapes[-1].buckets[LATENCY])
            if len(scrapes) > 1:
                _add(window, _bucket_increase(scrapes, LATENCY))
    scope, buckets = ("window", window) if window.get(math.inf, 0) > 0 else ("since start", since_start)
    if buckets.get(math.inf, 0) > 0:
        summary.latency_scope = scope
        summary.latency_p50_s = histogram_quantile(0.5, buckets)
        summary.latency_p90_s = histogram_quantile(0.9, buckets)


def _prefix_hit_rate(series: Series) -> float | None:
    reporting = [scrapes for scrapes in series if PREFIX_QUERIED in scrapes[-1].values and PREFIX_HIT in scrapes[-1].values]
    if not reporting:
        return None
    queried = sum(increase([s.values.get(PREFIX_QUERIED, 0.0) for s in scrapes]) for scrapes in reporting)
    if queried > 0:                    # the window's hit rate; an idle window shows the one since start
        return sum(increase([s.values.get(PREFIX_HIT, 0.0) for s in scrapes]) for scrapes in reporting) / queried
    queried = sum(scrapes[-1].values[PREFIX_QUERIED] for scrapes in reporting)
    return sum(scrapes[-1].values[PREFIX_HIT] for scrapes in reporting) / queried if queried > 0 else None


def summarize(scrapes: list[Scrape]) -> Summary:
    """One server: rates over all of `scrapes` (oldest first); with a single scrape, only gauges and totals."""
    return summarize_replicas([scrapes])


def summarize_replicas(series: Series) -> Summary:
    """Several servers (a service's replicas): each one's rates from its own counters (a replica's restart is its
    own reset), then added up, as `sum(rate(...))` does."""
    summary = Summary(window_s=round(max(scrapes[-1].at - scrapes[0].at for scrapes in series), 3))
    _token_rates(series, summary)
    last = [scrapes[-1].values for scrapes in series]
    summary.running = _total([values.get(GAUGES["running"]) for values in last])
    summary.waiting = _total([values.get(GAUGES["waiting"]) for values in last])
    usage = [values[GAUGES["kv_cache_usage"]] for values in last if GAUGES["kv_cache_usage"] in values]
    summary.kv_cache_usage = sum(usage) / len(usage) if usage else None
    summary.prefix_hit_rate = _prefix_hit_rate(series)
    _latency(series, summary)
    return summary
