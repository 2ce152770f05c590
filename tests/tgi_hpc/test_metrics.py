"""`tgi-hpc metrics` arithmetic on recorded /metrics text: rates as Prometheus computes them (resets included),
quantiles from histogram buckets, and what is shown when a server does not report a metric."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from tgi_hpc.errors import TgiHpcError
from tgi_hpc.workflows.metrics import Scraper, histogram_quantile, increase, parse_exposition, sample, summarize, watch

RECORDED = (Path(__file__).parent / "data" / "engine_metrics.prom").read_text()


def exposition(*, prompt: float | None = None, generated: float | None = None, queried: float | None = None,
               hit: float | None = None, requests: float = 0, latency: dict[float, float] | None = None,
               running: float = 0, waiting: float = 0, kv: float = 0.0) -> str:
    """Text as the engine writes it once the token counters exist (counter families: `_total` and `_created`)."""
    lines = [f"# TYPE tgi_request_success untyped\ntgi_request_success {requests}",
             f"# TYPE tgi_batch_current_size gauge\ntgi_batch_current_size {running}",
             f"# TYPE tgi_queue_size gauge\ntgi_queue_size {waiting}",
             f"# TYPE tgi_kv_cache_usage gauge\ntgi_kv_cache_usage {kv}"]
    for name, value in (("tgi_prompt_tokens", prompt), ("tgi_generated_tokens", generated),
                        ("tgi_prefix_cache_queried_tokens", queried), ("tgi_prefix_cache_hit_tokens", hit)):
        if value is not None:
            lines.append(f"# HELP {name}_total tokens\n# TYPE {name}_total counter\n{name}_total {value}\n"
                         f"{name}_created 1.7e+09")
    if latency is not None:
        lines.append("# TYPE tgi_request_duration histogram")
        lines += [f'tgi_request_duration_bucket{{le="{"+Inf" if le == math.inf else le}"}} {count}'
                  for le, count in latency.items()]
        lines.append(f"tgi_request_duration_count {latency[math.inf]}")
    return "\n".join(lines) + "\n"


def test_the_recorded_engine_text_without_token_counters_falls_back_to_histogram_sums():
    first = parse_exposition(RECORDED, at=100.0)
    assert first.values["tgi_request_failure"] == 1.0     # labelled samples are summed
    later = RECORDED.replace("tgi_request_input_length_sum 46.0", "tgi_request_input_length_sum 146.0") \
                    .replace("tgi_request_generated_tokens_sum 126.0", "tgi_request_generated_tokens_sum 526.0")
    summary = summarize([first, parse_exposition(later, at=102.0)])
    assert summary.token_source == "histogram sums"
    assert (summary.prompt_tokens_per_s, summary.generated_tokens_per_s) == (50.0, 200.0)
    assert (summary.running, summary.waiting, summary.kv_cache_usage) == (3.0, 2.0, 0.25)
    assert summary.counters == {"prompt_tokens": 146.0, "generated_tokens": 526.0, "requests": 4.0, "failures": 1.0}
    # no request ended between the scrapes: the latency is over all requests since the start
    assert summary.latency_scope == "since start"
    assert summary.latency_p50_s == pytest.approx(1.0) and summary.latency_p90_s == pytest.approx(4.0)
    assert summary.prefix_hit_rate is None and summary.requests_per_s == 0.0


def test_counters_win_over_histogram_sums_when_both_are_there():
    text = RECORDED + exposition(prompt=1000, generated=10)
    summary = summarize([parse_exposition(text, 0.0), parse_exposition(text.replace(
        "tgi_prompt_tokens_total 1000", "tgi_prompt_tokens_total 1500"), 5.0)])
    assert summary.token_source == "counters"
    assert summary.prompt_tokens_per_s == 100.0 and summary.generated_tokens_per_s == 0.0
    assert summary.counters["prompt_tokens"] == 1500


def test_increase_counts_a_reset_from_zero_as_prometheus_does():
    assert increase([10, 15, 20]) == 10
    assert increase([10, 15, 3, 7]) == 5 + 3 + 4      # restarted: the 3 after the drop counts whole
    assert increase([5, 0, 0]) == 0
    assert increase([7]) == 0 and increase([]) == 0


def test_a_restarted_server_gives_no_negative_rate():
    scrapes = [parse_exposition(exposition(prompt=p, generated=g), at=t)
               for t, p, g in ((0, 900, 400), (1, 1000, 450), (2, 40, 20), (3, 140, 70))]
    summary = summarize(scrapes)
    assert summary.prompt_tokens_per_s == pytest.approx((100 + 40 + 100) / 3)
    assert summary.generated_tokens_per_s == pytest.approx((50 + 20 + 50) / 3)


def test_quantiles_interpolate_inside_buckets_like_histogram_quantile():
    buckets = {0.1: 0, 0.5: 10, 1.0: 30, 2.5: 40, math.inf: 40}
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.75)     # rank 20: half way through (0.5, 1.0]
    assert histogram_quantile(0.9, buckets) == pytest.approx(1.0 + 1.5 * 6 / 10)
    assert histogram_quantile(0.1, {1.0: 10, math.inf: 10}) == pytest.approx(0.1)   # the first bucket starts at 0


def test_quantiles_in_the_inf_bucket_missing_data_and_scrape_skew():
    assert histogram_quantile(0.9, {1.0: 1, 2.0: 2, math.inf: 10}) == 2.0   # the highest finite bound
    assert histogram_quantile(0.5, {1.0: 0, math.inf: 0}) is None          # nothing observed
    assert histogram_quantile(0.5, {1.0: 3, 2.0: 5}) is None               # no +Inf bucket: not a histogram
    assert histogram_quantile(0.5, {}) is None
    # a bucket read lower than the one below it (separate reads) is taken as monotonic, not negative
    assert histogram_quantile(0.5, {1.0: 6, 2.0: 4, math.inf: 10}) == pytest.approx(5 / 6)


def test_latency_over_the_window_uses_bucket_increases():
    before = {0.5: 100, 1.0: 100, 5.0: 100, math.inf: 100}     # 100 fast requests long ago
    after = {0.5: 100, 1.0: 100, 5.0: 110, math.inf: 110}      # 10 slow ones in the window
    summary = summarize([parse_exposition(exposition(latency=before), 0), parse_exposition(exposition(latency=after), 1)])
    assert summary.latency_scope == "window"
    assert summary.latency_p50_s == pytest.approx(3.0)    # half way through (1, 5], not the fast old ones


def test_prefix_hit_rate_over_the_window_then_since_start():
    busy = [parse_exposition(exposition(queried=q, hit=h), t) for t, q, h in ((0, 100, 50), (1, 300, 200))]
    assert summarize(busy).prefix_hit_rate == pytest.approx(150 / 200)
    idle = [parse_exposition(exposition(queried=300, hit=200), t) for t in (0, 1)]
    assert summarize(idle).prefix_hit_rate == pytest.approx(200 / 300)
    assert summarize([parse_exposition(exposition(queried=0, hit=0), 0)]).prefix_hit_rate is None


def test_a_server_without_any_of_the_metrics_shows_nothing_rather_than_zeros():
    summary = summarize([parse_exposition("# TYPE up gauge\nup 1\n", 0), parse_exposition("up 1\n", 1)])
    assert summary.token_source == "none"
    assert summary.prompt_tokens_per_s is None and summary.generated_tokens_per_s is None
    assert summary.running is None and summary.kv_cache_usage is None and summary.latency_p50_s is None
    assert summary.counters == {}


def test_a_single_scrape_has_gauges_but_no_rates():
    summary = summarize([parse_exposition(exposition(prompt=10, running=2, waiting=5, kv=0.5), 0)])
    assert summary.prompt_tokens_per_s is None and (summary.running, summary.waiting, summary.kv_cache_usage) == (2, 5, 0.5)


def test_not_prometheus_text_is_an_error():
    with pytest.raises(ValueError):
        parse_exposition("<html>502 Bad Gateway</html>\n", 0)


class _Server:
    """A fake /metrics endpoint behind httpx's MockTransport, answering a script of texts."""

    def __init__(self, texts: list[str], status: int = 200):
        import httpx

        self.texts, self.status = list(texts), status
        self.transport = httpx.MockTransport(lambda request: httpx.Response(self.status, text=self.texts.pop(0)))


def _scraper(server: _Server, clock) -> Scraper:
    import httpx

    scraper = Scraper("http://test", clock=clock)
    scraper._client = httpx.Client(base_url="http://test", transport=server.transport)
    return scraper


def test_sample_is_two_scrapes_interval_apart_and_watch_keeps_a_window():
    now = [0.0]
    server = _Server([exposition(generated=g) for g in (0, 20, 40, 60, 100, 100)])
    scraper = _scraper(server, clock=lambda: now[0])

    def sleep(seconds):
        now[0] += seconds

    assert sample(scraper, 2.0, sleep=sleep).generated_tokens_per_s == 10.0
    views = watch(scraper, interval=1.0, window=2.0, sleep=sleep)
    rates = [next(views).generated_tokens_per_s for _ in range(4)]
    assert rates == [None, 20.0, 30.0, 20.0]   # the last one spans 2 s: the oldest scrape has left the window


def test_an_error_page_or_garbage_is_a_clear_error():
    scraper = _scraper(_Server(["oops"], status=502), clock=lambda: 0.0)
    with pytest.raises(TgiHpcError, match="answered 502"):
        scraper.scrape()
    scraper = _scraper(_Server(["<html>\n"]), clock=lambda: 0.0)
    with pytest.raises(TgiHpcError, match="not Prometheus text"):
        scraper.scrape()
