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
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tgi_hpc.errors import TgiHpcError

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
    """What `tgi-hpc metrics` shows: rates over the window, gauges from the last scrape, counters since start."""

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
    token_source: str = "none"         # "counters", "histogram sums" or "none"
    counters: dict[str, float] = field(default_factory=dict)
    job_id: str = ""
    url: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def _first_present(scrape: Scrape, names: tuple[str, ...]) -> str | None:
    return next((name for name in names if name in scrape.values), None)


def _rate(scrapes: list[Scrape], name: str | None) -> float | None:
    span = scrapes[-1].at - scrapes[0].at
    if name is None or span <= 0 or any(name not in s.values for s in scrapes):
        return None
    return increase([s.values[name] for s in scrapes]) / span


def _bucket_increase(scrapes: list[Scrape], name: str) -> dict[float, float]:
    bounds = set.intersection(*(set(s.buckets.get(name, {})) for s in scrapes))
    return {le: increase([s.buckets[name][le] for s in scrapes]) for le in bounds}


def _latency(scrapes: list[Scrape], summary: Summary) -> None:
    if LATENCY not in scrapes[-1].buckets:
        return
    window = _bucket_increase(scrapes, LATENCY) if len(scrapes) > 1 else {}
    scope, buckets = ("window", window) if window.get(math.inf, 0) > 0 else ("since start", scrapes[-1].buckets[LATENCY])
    if buckets.get(math.inf, 0) > 0:
        summary.latency_scope = scope
        summary.latency_p50_s = histogram_quantile(0.5, buckets)
        summary.latency_p90_s = histogram_quantile(0.9, buckets)


def _prefix_hit_rate(scrapes: list[Scrape]) -> float | None:
    last = scrapes[-1].values
    if PREFIX_QUERIED not in last or PREFIX_HIT not in last:
        return None
    queried = increase([s.values.get(PREFIX_QUERIED, 0.0) for s in scrapes])
    if queried > 0:                    # the window's hit rate; an idle window shows the one since start
        return increase([s.values.get(PREFIX_HIT, 0.0) for s in scrapes]) / queried
    return last[PREFIX_HIT] / last[PREFIX_QUERIED] if last[PREFIX_QUERIED] > 0 else None


def summarize(scrapes: list[Scrape]) -> Summary:
    """Rates over all of `scrapes` (oldest first); with a single scrape, only gauges and totals."""
    last = scrapes[-1]
    summary = Summary(window_s=round(last.at - scrapes[0].at, 3))
    prompt, generated = _first_present(last, PROMPT_TOKENS), _first_present(last, GENERATED_TOKENS)
    if prompt or generated:
        summary.token_source = "counters" if (prompt or generated).endswith("_total") else "histogram sums"
    summary.prompt_tokens_per_s = _rate(scrapes, prompt)
    summary.generated_tokens_per_s = _rate(scrapes, generated)
    summary.requests_per_s = _rate(scrapes, REQUESTS if REQUESTS in last.values else None)
    for attr, name in GAUGES.items():
        setattr(summary, attr, last.values.get(name))
    summary.prefix_hit_rate = _prefix_hit_rate(scrapes)
    _latency(scrapes, summary)
    totals = {"prompt_tokens": prompt, "generated_tokens": generated, "requests": REQUESTS, "failures": FAILURES,
              "prefix_cache_queried_tokens": PREFIX_QUERIED, "prefix_cache_hit_tokens": PREFIX_HIT}
    summary.counters = {key: last.values[name] for key, name in totals.items() if name and name in last.values}
    return summary


class Scraper:
    """GET /metrics from one server (/metrics needs no API key, but one is sent when known)."""

    def __init__(self, url: str, headers: dict[str, str] | None = None, timeout: float = 10.0,
                 clock: Callable[[], float] = time.monotonic):
        self._client = httpx.Client(base_url=url, headers=headers or {}, timeout=timeout, trust_env=False)
        self._clock = clock
        self.url = url

    def scrape(self) -> Scrape:
        try:
            response = self._client.get("/metrics")
        except httpx.HTTPError as exc:
            raise TgiHpcError(f"cannot read {self.url}/metrics: {exc} (is the job still running?)") from exc
        if response.status_code != 200:
            raise TgiHpcError(f"{self.url}/metrics answered {response.status_code}: {response.text[:200]}")
        try:
            return parse_exposition(response.text, self._clock())
        except ValueError as exc:
            raise TgiHpcError(f"{self.url}/metrics is not Prometheus text: {exc}") from exc

    def close(self) -> None:
        self._client.close()


def sample(scraper: Scraper, interval: float = 2.0, sleep: Callable[[float], None] = time.sleep) -> Summary:
    """One sample: two scrapes `interval` seconds apart, rates between them."""
    first = scraper.scrape()
    sleep(interval)
    return summarize([first, scraper.scrape()])


def watch(scraper: Scraper, interval: float = 1.0, window: float = 10.0,
          sleep: Callable[[float], None] = time.sleep) -> Iterator[Summary]:
    """A summary every `interval` seconds, rates over the scrapes of the last `window` seconds."""
    scrapes: deque[Scrape] = deque()
    while True:
        scrapes.append(scraper.scrape())
        while len(scrapes) > 2 and scrapes[-1].at - scrapes[1].at >= window:
            scrapes.popleft()
        yield summarize(list(scrapes))
        sleep(interval)
