"""Prometheus metrics under TGI's names (router/src/server.rs), one registry per app."""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


class _Counters:
    """TGI's counters keep their bare names (no `_total` suffix, which prometheus_client's
    Counter would add), so dashboards written for TGI work unchanged. They are exported untyped."""

    def __init__(self) -> None:
        self.values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = defaultdict(float)
        self.help = {"tgi_request_count": "Requests received",
                     "tgi_request_success": "Requests that finished",
                     "tgi_request_failure": "Requests that failed, by error type",
                     "tgi_lora_request_count": "Requests received for a LoRA adapter, by adapter"}

    def inc(self, name: str, **labels: str) -> None:
        self.values[(name, tuple(sorted(labels.items())))] += 1

    def collect(self) -> Iterator[Metric]:
        for name, doc in self.help.items():
            metric = Metric(name, doc, "unknown")
            samples = [(labels, v) for (n, labels), v in self.values.items() if n == name] or [((), 0.0)]
            for labels, value in samples:
                metric.add_sample(name, dict(labels), value)
            yield metric


class _EngineGauges:
    """Queue, batch and KV-cache gauges read from engine.stats() at scrape time."""

    def __init__(self, stats: Callable[[], Any]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        used_blocks = s.num_total_blocks - s.num_free_blocks
        values = {
            "tgi_queue_size": ("Requests waiting to be scheduled", s.num_waiting),
            "tgi_batch_current_size": ("Requests in the running batch", s.num_running),
            "tgi_batch_current_max_tokens": ("KV tokens reserved by the running batch", used_blocks * s.block_size),
            "tgi_kv_cache_blocks_total": ("KV-cache blocks", s.num_total_blocks),
            "tgi_kv_cache_blocks_free": ("Free KV-cache blocks", s.num_free_blocks),
            "tgi_kv_cache_usage": ("Fraction of KV-cache blocks in use",
                                   used_blocks / s.num_total_blocks if s.num_total_blocks else 0.0),
        }
        for name, (doc, value) in values.items():
            yield GaugeMetricFamily(name, doc, value=float(value))
        # per-step token counters (rates: rate(...[1m])); prefix-cache hit rate = hit / queried
        counters = {
            "tgi_prompt_tokens": ("Prompt tokens prefilled", "num_prompt_tokens_total"),
            "tgi_generated_tokens": ("Tokens generated", "num_generated_tokens_total"),
            "tgi_prefix_cache_queried_tokens": ("Prompt tokens looked up in the prefix cache",
                                                "num_prefix_cache_queried_tokens"),
            "tgi_prefix_cache_hit_tokens": ("Prompt tokens found in the prefix cache", "num_prefix_cache_hit_tokens"),
            "tgi_speculative_proposed_tokens": ("Draft tokens scored (--speculate)", "num_speculative_proposed_total"),
            "tgi_speculative_accepted_tokens": ("Draft tokens accepted", "num_speculative_accepted_total"),
            "tgi_steps_ahead": ("Batches launched before the previous one's tokens were read "
                                "(--async-scheduling)", "num_steps_ahead_total"),
        }
        for name, (doc, attr) in counters.items():  # exposed as NAME_total
            yield CounterMetricFamily(name, doc, value=float(getattr(s, attr, 0)))
        paths = getattr(s, "forward_steps", {})
        if paths:   # which forward each step took: decode CUDA graph, piecewise graphs, the CPU decode step, eager
            family = CounterMetricFamily("tgi_forward_steps", "Model forwards of the steps, by path", labels=["path"])
            for path, count in sorted(paths.items()):
                family.add_metric([path], float(count))
            yield family
        method = getattr(s, "speculative_method", "")
        if method:  # the same drafts per method (n-gram, layer skip), and the decodes `--speculate auto` skipped
            for name, doc, attr in (
                    ("tgi_speculative_method_proposed_tokens", "Draft tokens scored, by method",
                     "num_speculative_proposed_total"),
                    ("tgi_speculative_method_accepted_tokens", "Draft tokens accepted, by method",
                     "num_speculative_accepted_total"),
                    ("tgi_speculative_method_paused_decodes", "Decodes left undrafted by --speculate auto",
                     "num_speculative_paused_total")):
                family = CounterMetricFamily(name, doc, labels=["method"])
                family.add_metric([method], float(getattr(s, attr, 0)))
                yield family


class ServerMetrics:
    def __init__(self, stats: Callable[[], Any]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.counters = _Counters()
        self.registry.register(self.counters)  # type: ignore[arg-type]
        self.registry.register(_EngineGauges(stats))  # type: ignore[arg-type]

        def hist(name: str, doc: str, buckets: tuple[float, ...] = _DURATION_BUCKETS) -> Histogram:
            return Histogram(name, doc, buckets=buckets, registry=self.registry)

        self.duration = hist("tgi_request_duration", "End-to-end request time (s)")
        self.validation_duration = hist("tgi_request_validation_duration", "Validation and tokenization time (s)")
        self.queue_duration = hist("tgi_request_queue_duration", "Time from enqueue to first output (s)")
        self.inference_duration = hist("tgi_request_inference_duration", "Time from first output to end (s)")
        self.time_per_token = hist("tgi_request_mean_time_per_token_duration", "Mean time per generated token (s)")
        self.input_length = hist("tgi_request_input_length", "Prompt tokens", _TOKEN_BUCKETS)
        self.generated_tokens = hist("tgi_request_generated_tokens", "Generated tokens", _TOKEN_BUCKETS)

    def request(self) -> None:
        self.counters.inc("tgi_request_count")

    def adapter_request(self, adapter: str) -> None:
        self.counters.inc("tgi_lora_request_count", adapter=adapter)

    def failure(self, error_type: str) -> None:
        self.counters.inc("tgi_request_failure", err=error_type)

    def success(self, *, total_s: float, validation_s: float, queue_s: float, inference_s: float,
                generated_tokens: int) -> None:
        self.counters.inc("tgi_request_success")
        self.duration.observe(total_s)
        self.validation_duration.observe(validation_s)
        self.queue_duration.observe(queue_s)
        self.inference_duration.observe(inference_s)
        self.time_per_token.observe(inference_s / max(generated_tokens, 1))
        self.generated_tokens.observe(generated_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
