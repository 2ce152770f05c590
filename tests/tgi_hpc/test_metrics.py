"""`tgi-hpc metrics` arithmetic on recorded /metrics text: rates as Prometheus computes them (resets included),
quantiles from histogram buckets, and what is shown when a server does not report a metric."""
from __future__ import annotations

import math
from pathlib import Path

import httpx
import pytest

from tgi_hpc.errors import TgiHpcError
from tgi_hpc.workflows.metrics import histogram_quantile, increase, parse_exposition, summarize, summarize_replicas
from tgi_hpc.workflows.scrape import Fleet, Scraper, sample, watch

RECORDED = (Path(__file__).parent / "data" / "engine_metrics.prom").read_text()
RECORDED_COUNTERS = (Path(__file__).parent / "data" / "engine_metrics_counters.prom").read_text()


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


def test_the_recorded_engine_text_with_token_and_prefix_counters():
    first = parse_exposition(RECORDED_COUNTERS, at=10.0)
    later = RECORDED_COUNTERS.replace("tgi_generated_tokens_total 900.0", "tgi_generated_tokens_total 1300.0") \
        .replace("tgi_prefix_cache_queried_tokens_total 4096.0", "tgi_prefix_cache_queried_tokens_total 5096.0") \
        .replace("tgi_prefix_cache_hit_tokens_total 1024.0", "tgi_prefix_cache_hit_tokens_total 1924.0")
    summary = summarize([first, parse_exposition(later, at=14.0)])
    assert summary.token_source == "counters"
    assert summary.generated_tokens_per_s == 100.0 and summary.prompt_tokens_per_s == 0.0
    assert summary.prefix_hit_rate == pytest.approx(900 / 1000)
    assert summary.counters["prefix_cache_queried_tokens"] == 5096 and summary.counters["prompt_tokens"] == 5120
    assert (summary.running, summary.waiting, summary.kv_cache_usage) == (4, 1, 0.25)
    assert summarize([first]).prefix_hit_rate == pytest.approx(1024 / 4096)   # one scrape: since the start


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
        self.texts, self.status = list(texts), status
        self.transport = httpx.MockTransport(self.answer)

    def answer(self, request: httpx.Request) -> httpx.Response:
        if not self.texts:
            raise httpx.ConnectError("connection refused")
        return httpx.Response(self.status, text=self.texts.pop(0))


def _fleet(servers: dict[str, _Server], clock, replicas=None) -> Fleet:
    """A Fleet over fake servers: URL http://<job id> -> that server."""

    def make(url: str, headers: dict) -> Scraper:
        scraper = Scraper(url, headers, clock=clock)
        scraper._client = httpx.Client(base_url=url, transport=servers[url.split("//")[1]].transport)
        return scraper

    return Fleet(replicas or (lambda: {job: f"http://{job}" for job in servers}), make_scraper=make)


def test_sample_is_two_scrapes_interval_apart_and_watch_keeps_a_window():
    now = [0.0]
    fleet = _fleet({"4148": _Server([exposition(generated=g) for g in (0, 20, 40, 60, 100, 100)])},
                   clock=lambda: now[0])

    def sleep(seconds):
        now[0] += seconds

    one = sample(fleet, 2.0, sleep=sleep)
    assert one.generated_tokens_per_s == 10.0 and one.replicas == ["4148"] and one.window_s == 2.0
    views = watch(fleet, interval=1.0, window=2.0, sleep=sleep)
    rates = [next(views).generated_tokens_per_s for _ in range(4)]
    assert rates == [None, 20.0, 30.0, 20.0]   # the last one spans 2 s: the oldest scrape has left the window


def test_replicas_are_rated_each_on_its_own_then_added_up():
    a = [parse_exposition(exposition(generated=g, running=2, waiting=1, kv=0.2,
                                     latency={1.0: n, 5.0: n, math.inf: n}), t)
         for t, g, n in ((0, 100, 10), (2, 300, 20))]
    # the other replica restarted between the scrapes (a successor reusing nothing): 500 -> 60 counts as 60
    b = [parse_exposition(exposition(generated=g, running=1, waiting=0, kv=0.6,
                                     latency={1.0: 0, 5.0: n, math.inf: n}), t)
         for t, g, n in ((0, 500, 30), (2, 60, 10))]
    summary = summarize_replicas([a, b])
    assert summary.generated_tokens_per_s == pytest.approx(200 / 2 + 60 / 2)
    assert (summary.running, summary.waiting) == (3, 1) and summary.kv_cache_usage == pytest.approx(0.4)
    assert summary.counters["generated_tokens"] == 360
    # window latency: 10 fast requests on a, 10 slow ones on b (its whole count after the restart)
    assert summary.latency_scope == "window" and summary.latency_p90_s > 1.0 and summary.latency_p50_s == 1.0


def test_a_fleet_follows_replicas_that_come_and_go_and_skips_one_that_stopped_answering():
    now = [0.0]
    servers = {"1": _Server([exposition(generated=g) for g in (0, 10, 20)]),
               "2": _Server([exposition(generated=g) for g in (0, 50)]),
               "3": _Server([])}                        # listed READY but refusing: left out
    current = [{"1": "http://1"}]
    fleet = _fleet(servers, clock=lambda: now[0], replicas=lambda: current[0])
    views = watch(fleet, interval=1.0, window=10.0, sleep=lambda s: now.__setitem__(0, now[0] + s))
    assert next(views).replicas == ["1"]
    current[0] = {"1": "http://1", "2": "http://2", "3": "http://3"}      # a successor, and a broken one
    view = next(views)
    assert view.replicas == ["1", "2"] and view.generated_tokens_per_s == 10.0   # 2 has one scrape: no rate yet
    current[0] = {"2": "http://2"}                                          # 1 handed over
    view = next(views)
    assert view.replicas == ["2"] and view.generated_tokens_per_s == 50.0
    current[0] = {"3": "http://3"}
    with pytest.raises(TgiHpcError, match="cannot read http://3/metrics"):
        next(views)
    current[0] = {}
    with pytest.raises(TgiHpcError, match="none is READY"):
        fleet.scrape()


def test_an_error_page_or_garbage_is_a_clear_error():
    scraper = _fleet({"1": _Server(["oops"], status=502)}, clock=lambda: 0.0)
    with pytest.raises(TgiHpcError, match="answered 502"):
        scraper.scrape()
    scraper = _fleet({"1": _Server(["<html>\n"])}, clock=lambda: 0.0)
    with pytest.raises(TgiHpcError, match="not Prometheus text"):
        scraper.scrape()
