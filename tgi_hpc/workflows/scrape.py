"""Reading /metrics from the servers behind a target, over time: one scraper per server, the set of servers
asked again each round (a service's replicas come and go), one sample (`--json`) or a sliding window (live)."""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator

import httpx

from tgi_hpc.errors import TgiHpcError
from tgi_hpc.workflows.metrics import Scrape, Summary, parse_exposition, summarize_replicas


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


class Fleet:
    """The servers behind a target, each scraped on its own: `replicas()` maps job id -> URL reachable from here
    and is asked again each round, so replicas that come (a successor) or go (handed over) are followed."""

    def __init__(self, replicas: Callable[[], dict[str, str]], headers: dict[str, str] | None = None,
                 make_scraper: Callable[[str, dict[str, str]], Scraper] = Scraper):
        self._replicas, self._headers, self._make = replicas, headers or {}, make_scraper
        self._scrapers: dict[str, Scraper] = {}

    def scrape(self) -> dict[str, Scrape]:
        """One scrape per replica; one that does not answer (ended, draining away) is left out, unless none does."""
        current = self._replicas()
        for job_id in set(self._scrapers) - set(current):
            self._scrapers.pop(job_id).close()
        found, errors = {}, []
        for job_id, url in current.items():
            if job_id not in self._scrapers or self._scrapers[job_id].url != url:
                self._scrapers[job_id] = self._make(url, self._headers)
            try:
                found[job_id] = self._scrapers[job_id].scrape()
            except TgiHpcError as exc:
                errors.append(str(exc))
        if not found:
            raise TgiHpcError("; ".join(errors) or "no replica to read /metrics from (none is READY)")
        return found

    def close(self) -> None:
        for scraper in self._scrapers.values():
            scraper.close()
        self._scrapers.clear()


def _summary(windows: dict[str, list[Scrape]]) -> Summary:
    summary = summarize_replicas(list(windows.values()))
    summary.replicas = sorted(windows)
    return summary


def sample(fleet: Fleet, interval: float = 2.0, sleep: Callable[[float], None] = time.sleep) -> Summary:
    """One sample: two scrapes `interval` seconds apart, rates between them."""
    first = fleet.scrape()
    sleep(interval)
    second = fleet.scrape()
    return _summary({job_id: ([first[job_id]] if job_id in first else []) + [scrape]
                     for job_id, scrape in second.items()})


def watch(fleet: Fleet, interval: float = 1.0, window: float = 10.0,
          sleep: Callable[[float], None] = time.sleep) -> Iterator[Summary]:
    """A summary every `interval` seconds, rates over the scrapes of the last `window` seconds."""
    windows: dict[str, deque[Scrape]] = {}
    while True:
        scraped = fleet.scrape()
        windows = {job_id: windows.get(job_id, deque()) for job_id in scraped}
        for job_id, scrape in scraped.items():
            scrapes = windows[job_id]
            scrapes.append(scrape)
            while len(scrapes) > 2 and scrapes[-1].at - scrapes[1].at >= window:
                scrapes.popleft()
        yield _summary({job_id: list(scrapes) for job_id, scrapes in windows.items()})
        sleep(interval)
